"""The host's registry of named deployments (deployment_registry.py): one file per deployment, private to
its user, stale entries removed by whoever reads them, one live deployment per name."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from mii_async import InvalidParameterError
from mii_async import deployment_registry as registry


@pytest.fixture
def registry_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MII_ASYNC_CACHE", str(tmp_path))
    return tmp_path / "deployments"


@pytest.fixture
def other_process():
    """A live process of this user: its pid stands for another deployment's router."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _register(name, pid, address="tcp://127.0.0.1:5555", terminate=False):
    return registry.register(name=name, address=address, pid=pid, model="m", http_url=None, curve_dir=None,
                             terminate_route=terminate)


def test_an_entry_is_private_and_found_by_name_and_address(registry_home):
    """The file is mode 600 in a directory of mode 700, and holds addresses, not keys."""
    e = _register("mydep", os.getpid(), terminate=True)
    assert stat.S_IMODE(os.stat(e.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(registry_home).st_mode) == 0o700
    assert registry.find("mydep") == e and registry.find_by_address("tcp://127.0.0.1:5555") == e
    assert e.terminate_route and e.owner_pid == os.getpid()
    registry.unregister(e)
    assert registry.find("mydep") is None and not os.path.exists(e.path)


def test_a_live_deployments_name_is_refused(registry_home, other_process):
    _register("taken", other_process)
    with pytest.raises(InvalidParameterError, match="running deployment") as err:
        _register("taken", os.getpid(), address="tcp://127.0.0.1:6000")
    assert err.value.param == "deployment_name"
    assert _register(None, os.getpid(), address="tcp://127.0.0.1:6000").name is None   # unnamed: by address only


def test_stale_entries_are_removed_by_their_readers(registry_home, other_process):
    """An entry whose router exited, or whose pid another process now holds (its start time differs), is
    stale: left out and removed; a torn file is skipped."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = _register("dead", gone.pid)
    reused = _register("reused", other_process)
    data = json.loads(open(reused.path).read())
    data["pid_start"] = "1"
    with open(reused.path, "w") as f:
        json.dump(data, f)
    (registry_home / "torn.json").write_text('{"name": ')
    live = _register("live", os.getpid(), address="tcp://127.0.0.1:7000")
    assert registry.live_entries() == [live]
    assert not os.path.exists(dead.path) and not os.path.exists(reused.path)
    assert registry.find("dead") is None
    _register("dead", os.getpid(), address="tcp://127.0.0.1:7001")      # its name is free again


def test_unregister_leaves_a_newer_deployments_entry(registry_home, other_process):
    first = _register("n1", other_process)
    os.remove(first.path)
    newer = _register("n2", other_process, address="tcp://127.0.0.1:5556")   # the same pid's file, rewritten
    registry.unregister(first._replace(pid=first.pid + 1))
    assert registry.find("n2") == newer
