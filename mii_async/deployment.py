"""RouterProcess: a router started by `mii_async.serve()`, as a child process of the caller.

The router gets a lifeline (it stops, with its workers, when this process goes away, however that happens)
and a status pipe on which it writes one JSON line once every replica is ready, or why it could not start.
"""
from __future__ import annotations

import json
import os
import select
import sys
import time

from .config import EngineConfig, ServeConfig
from .errors import UnavailableError, error_from_code
from .lifecycle import Child


class RouterProcess:
    def __init__(self, serve: ServeConfig, engine: EngineConfig) -> None:
        status_r, status_w = os.pipe()
        config = json.dumps({"serve": serve.to_dict(), "engine": engine.to_dict()})
        try:
            self.child = Child([sys.executable, "-m", "mii_async.router", "--config", config,
                                "--status-fd", str(status_w)], "router", extra_fds=(status_w,))
        finally:
            os.close(status_w)
        try:
            status = _read_status(status_r, serve.startup_timeout_s + 60, self.child)
        except BaseException:
            self.child.stop(5.0)
            raise
        finally:
            os.close(status_r)
        if "error" in status:
            self.child.stop(10.0)
            raise error_from_code(status.get("code", "unavailable"), status["error"], status.get("param"))
        self.status = status
        self.address: str = status["address"].replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
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


def _read_status(fd: int, timeout_s: float, child: Child) -> dict:
    buf = b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise UnavailableError(f"the router did not become ready within {timeout_s:.0f} s")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            child.proc.wait(timeout=10)
            raise UnavailableError(f"the router exited before it was ready: {child.describe_exit()}")
        buf += chunk
    return json.loads(buf.split(b"\n", 1)[0])
