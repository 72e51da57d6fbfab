"""RouterProcess and GatewayProcess: a deployment's processes started by `mii_async.serve()` (and the gateway by
`mii-async serve`), as children of the caller.

Each gets a lifeline (it stops, with its own children, when this process goes away, however that happens) and
a status pipe on which it writes one JSON line once it is ready, or why it could not start.
"""
from __future__ import annotations

import json
import os
import select
import sys
import time

from .config import EngineConfig, HttpConfig, ServeConfig
from .errors import UnavailableError, error_from_code
from .lifecycle import Child


def _start_with_status(argv: list[str], name: str, timeout_s: float, env: dict[str, str] | None = None
                       ) -> tuple[Child, dict]:
    """Starts a child that reports on `--status-fd`; returns it and its status (raises if it failed)."""
    status_r, status_w = os.pipe()
    try:
        child = Child(argv + ["--status-fd", str(status_w)], name, env=env, extra_fds=(status_w,))
    finally:
        os.close(status_w)
    try:
        status = _read_status(status_r, timeout_s, child, name)
    except BaseException:
        child.stop(5.0)
        raise
    finally:
        os.close(status_r)
    if "error" in status:
        child.stop(10.0)
        raise error_from_code(status.get("code", "unavailable"), status["error"], status.get("param"))
    return child, status


class RouterProcess:
    def __init__(self, serve: ServeConfig, engine: EngineConfig) -> None:
        config = json.dumps({"serve": serve.to_dict(), "engine": engine.to_dict()})
        self.child, status = _start_with_status([sys.executable, "-m", "mii_async.router", "--config", config],
                                                "router", serve.startup_timeout_s + 60)
        self.status = status
        self.address: str = status["address"].replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
        self.curve_dir: str = status["curve_dir"]     # the mesh's keys (mesh_keys.py): the operator's among them
        self.pid = self.child.pid

    def wait(self, timeout_s: float) -> bool:
        """Waits for the router to exit; True if it did."""
        deadline = time.monotonic() + timeout_s
        while self.child.poll() is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        self.child.stop(timeout_s)


class GatewayProcess:
    """The HTTP/WebSocket gateway in front of the router at `router_address`."""

    def __init__(self, router_address: str, http: HttpConfig, curve_dir: str | None = None,
                 drain_s: float = 30.0, tokenizer: str | None = None) -> None:
        """`tokenizer`: the model directory whose tokenizer /tokenize and /detokenize use, where the router's is
        not on this host (default: the router's)."""
        from .gateway.main import API_KEY_ENV

        cfg = {k: v for k, v in http.to_dict().items() if k != "api_key"}
        env = dict(os.environ)                              # $MII_ASYNC_API_KEY, when set, passes on
        if http.api_key:
            env[API_KEY_ENV] = http.api_key                 # not on the command line, where ps shows it
        argv = [sys.executable, "-m", "mii_async.gateway", "--router", router_address, "--config", json.dumps(cfg),
                "--drain-timeout", str(drain_s)] + (["--curve-dir", curve_dir] if curve_dir else []) \
            + (["--tokenizer", tokenizer] if tokenizer else [])
        self.child, status = _start_with_status(argv, "gateway", 120.0, env=env)
        self.url: str = status["url"]
        self.pid = self.child.pid
        self.http = http                    # its settings: client.jobs takes its jobs_dir and job limits

    def stop(self, timeout_s: float = 10.0) -> None:
        self.child.stop(timeout_s)


def _read_status(fd: int, timeout_s: float, child: Child, name: str) -> dict:
    buf = b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise UnavailableError(f"the {name} did not become ready within {timeout_s:.0f} s")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            child.proc.wait(timeout=10)
            raise UnavailableError(f"the {name} exited before it was ready: {child.describe_exit()}")
        buf += chunk
    return json.loads(buf.split(b"\n", 1)[0])
