"""RunnerLease: which process runs the lines of one `jobs_dir` — the one holding an flock on `jobs_dir/lock`.

Any number of processes may open a directory's store to upload, submit, read and cancel; exactly one runs the
lines, or two runners would each send every line. The kernel drops the lock when its holder dies (kill -9
included), so another process's `try_take` then succeeds and its runner takes up the unfinished batches.
An flock belongs to one open file description: two leases in one process exclude each other as two processes do.
"""
from __future__ import annotations

import fcntl
import os


class RunnerLease:
    def __init__(self, jobs_dir: str) -> None:
        self.path = os.path.join(jobs_dir, "lock")
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_take(self) -> bool:
        """Takes the lease if no process holds it, without waiting; True when this lease holds it now."""
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)          # closing the descriptor drops the flock
            self._fd = None
