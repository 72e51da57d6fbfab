"""Process lifecycles: named child processes tied to their parent by a lifeline pipe.

A parent starts each child with the read end of a pipe whose write end only the parent holds. The child
watches it: end of file means the parent is gone (exited, crashed, killed with -9), and the child exits too.
This works whatever way the parent died, which neither atexit handlers nor signals do, and so no test or
user session leaves an orphan. On Linux a worker also asks the kernel to kill it when its parent dies (prctl),
as a second line. Imports no torch.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Coroutine

log = logging.getLogger("mii_async.lifecycle")
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, arg: int | bytes) -> None:
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def set_process_name(name: str) -> None:
    """Names this process (what `ps -o comm` and `top` show; 15 bytes at most on Linux)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


def die_with_parent() -> None:
    """SIGKILL when the parent dies: a worker the router started leaves SIGTERM to the router."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Child:
    """A started child process and the write end of its lifeline (closing it tells the child to exit)."""

    def __init__(self, argv: list[str], name: str, env: dict[str, str] | None = None,
                 extra_fds: tuple[int, ...] = ()) -> None:
        read_fd, self._lifeline = os.pipe()
        self.name = name
        try:
            self.proc = subprocess.Popen(argv + ["--lifeline-fd", str(read_fd)], pass_fds=(read_fd, *extra_fds),
                                         env=env, start_new_session=False)
        finally:
            os.close(read_fd)
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def describe_exit(self) -> str:
        code = self.proc.returncode
        if code is None:
            return f"{self.name} (pid {self.pid}) is running"
        if code < 0:
            try:
                sig = signal.Signals(-code).name
            except ValueError:                        # a real-time signal has no name
                sig = f"signal {-code}"
            return f"{self.name} (pid {self.pid}) was killed by {sig}"
        return f"{self.name} (pid {self.pid}) exited with status {code}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Closes the lifeline, then SIGTERM, then SIGKILL, waiting up to `timeout_s` in all. Idempotent."""
        self.cut_lifeline()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=min(2.0, timeout_s / 2))
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=timeout_s / 2)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()

    def cut_lifeline(self) -> None:
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1


def watch_lifeline(fd: int, on_parent_exit: Callable[[], None]) -> threading.Thread:
    """Calls `on_parent_exit` (on a daemon thread) when the parent closes or loses the lifeline."""
    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        log.info("parent process is gone")
        on_parent_exit()

    t = threading.Thread(target=watch, name="mii_async-lifeline", daemon=True)
    t.start()
    return t


def run_uvloop(coro: Coroutine[Any, Any, int]) -> int:
    """Runs a process's main coroutine on uvloop (asyncio's own loop where uvloop is not installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
