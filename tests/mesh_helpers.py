"""Helpers for tests of real deployments: waiting on conditions, checking that processes are gone."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """Waits for every pid to exit; returns those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


async def until(pred: Callable[[], Awaitable[Any]], timeout_s: float, what: str, period_s: float = 0.05) -> Any:
    """Polls an async predicate until it returns something truthy; fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {value!r})")
        await asyncio.sleep(period_s)


async def kv_idle(client: Any, timeout_s: float = 5.0) -> dict:
    """Waits until no request holds KV blocks and none is queued; returns the stats."""
    async def idle() -> dict | None:
        s = await client.stats()
        return s if s["used_blocks"] == 0 and s["running"] == 0 and s["waiting"] == 0 else None
    return await until(idle, timeout_s, "KV blocks back at the idle baseline")


def deployment_pids(health: dict) -> list[int]:
    return [p for r in health["replicas"] for p in r["pids"]]


def with_word_tokenizer(model_dir: Any, out_dir: Any, vocab_size: int = 320) -> Any:
    """A copy of a tiny random model plus a word-level tokenizer over its vocabulary, so that a deployment
    (whose router tokenizes and detokenizes) can serve it."""
    import shutil

    from mii_async.bench.word_tokenizer import save_word_tokenizer

    shutil.copytree(model_dir, out_dir)
    save_word_tokenizer(out_dir, vocab_size)
    return out_dir


def present_keys(sock: Any, keys_dir: str, role: str) -> None:
    """Makes a raw zmq socket a CURVE client of the deployment whose keys are in `keys_dir`, as `role`
    (mesh_keys.ROLES): set before connect."""
    from mii_async.mesh_keys import credentials

    creds = credentials(keys_dir, role)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = creds.server_public, creds.public, creds.secret


def raw_dealer(ctx: Any, address: str, role: str = "client") -> Any:
    """A raw zmq DEALER (linger 0) holding this user's keys for the deployment at `address` (mesh_keys finds
    them by port), not yet connected."""
    import zmq

    from mii_async.mesh_keys import find_keys

    keys = find_keys(address)
    assert keys is not None, f"no mesh keys published for {address}"
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    present_keys(s, keys, role)
    return s
