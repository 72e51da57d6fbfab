"""The deployments started on this host, by name: how `mii_async.client("name")` finds one (DeepSpeed-MII's
`mii.client(deployment_name)`), and how a gateway knows the name it answers to on `POST /mii/{name}`.

One JSON file per deployment, `<cache dir>/deployments/<router pid>.json` (the cache dir: $MII_ASYNC_CACHE, else
~/.cache/mii_async), written by the process that called `serve()` once the deployment is ready, mode 600 in a
directory of mode 700; it holds addresses, never keys. An entry whose router is gone (its pid dead, or reused
by another process: the start time differs) is stale, and is removed by whoever reads it. A name is held by
one live deployment at a time. Entries another user wrote are never read: they could point a client at a
router of theirs.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any, NamedTuple

from .config import default_cache_dir
from .errors import InvalidParameterError
from .user_state import private_dir, process_alive, process_start_time

log = logging.getLogger("mii_async.deployment_registry")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class Entry(NamedTuple):
    name: str | None            # the deployment's name (serve(deployment_name=…)); None: found by address only
    address: str                # the router's client address, tcp://HOST:PORT
    pid: int                    # the router's pid: the deployment lives as long as it does
    pid_start: str | None       # that process's start time (Linux /proc), so that a reused pid is not taken for it
    owner_pid: int              # the process that called serve(); the deployment ends when it exits
    model: str | None           # the model as serve() was given it (None: the default model)
    http_url: str | None        # the gateway's base URL, when serve() started one
    curve_dir: str | None       # the mesh's keys directory (its path, never a key)
    terminate_route: bool       # whether the gateway answers GET /terminate
    path: str                   # the entry's file


def registry_dir() -> str:
    return os.path.join(default_cache_dir(), "deployments")


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidParameterError("deployment_name", "must be 1 to 128 letters, digits, '.', '_' or '-', starting "
                                    f"with a letter or digit (it names the REST route /mii/NAME); got {name!r}")
    return name


def live_entries() -> list[Entry]:
    """The live deployments of this user on this host; stale entries are removed on the way."""
    root = registry_dir()
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    out = []
    for fname in names:
        if not fname.endswith(".json"):
            continue
        entry = _read(os.path.join(root, fname))
        if entry is None:
            continue
        if process_alive(entry.pid, entry.pid_start):
            out.append(entry)
        else:
            _remove(entry.path)
    return out


def find(name: str) -> Entry | None:
    return next((e for e in live_entries() if e.name == name), None)


def find_by_address(address: str) -> Entry | None:
    return next((e for e in live_entries() if e.address == address), None)


def check_name_free(name: str) -> None:
    """Refuses a name a live deployment holds (checked before starting one, and again when it registers)."""
    held = find(check_name(name))
    if held is not None:
        raise InvalidParameterError("deployment_name", f"'{name}' is the name of the running deployment at "
                                    f"{held.address} (router pid {held.pid}); stop it, or choose another name")


def register(*, name: str | None, address: str, pid: int, model: str | None, http_url: str | None,
             curve_dir: str | None, terminate_route: bool) -> Entry:
    """Writes the entry of a ready deployment (mode 600, atomically) and returns it."""
    if name is not None:
        check_name_free(name)
    root = private_dir(registry_dir(), "cache_dir")
    path = os.path.join(root, f"{pid}.json")
    data = {"name": name, "address": address, "pid": pid, "pid_start": process_start_time(pid),
            "owner_pid": os.getpid(), "model": model, "http_url": http_url, "curve_dir": curve_dir,
            "terminate_route": terminate_route, "created": time.time()}
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    entry = _read(path)
    assert entry is not None, f"the registry entry {path} did not read back"
    return entry


def unregister(entry: Entry) -> None:
    """Removes `entry`'s file if it is still that deployment's (idempotent)."""
    current = _read(entry.path)
    if current is not None and current.pid == entry.pid and current.pid_start == entry.pid_start:
        _remove(entry.path)


def _read(path: str) -> Entry | None:
    try:
        st = os.stat(path)
        if st.st_uid != os.getuid():
            return None
        with open(path) as f:
            d = json.load(f)
        return Entry(d["name"], d["address"], int(d["pid"]), d.get("pid_start"), int(d["owner_pid"]), d.get("model"),
                     d.get("http_url"), d.get("curve_dir"), bool(d.get("terminate_route")), path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:      # torn or foreign: not an entry of ours
        log.warning("ignoring the unreadable deployment entry %s: %s", path, exc)
        return None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
