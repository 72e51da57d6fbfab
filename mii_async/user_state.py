"""What this user keeps on disk about running deployments (mesh keys, the by-name registry): directories only
this user can read, and whether the process an entry names is still the one that wrote it."""
from __future__ import annotations

import os

from .errors import InvalidParameterError


def private_dir(path: str, param: str) -> str:
    """Creates `path` (mode 700) or checks that an existing one is this user's and closed to others (what
    another user can write there could be swapped for theirs); `param` is named when it is not."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise InvalidParameterError(param, f"{path} belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def process_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]      # fields after the command name, which may hold spaces


def process_alive(pid: int, start: str | None = None) -> bool:
    """Whether `pid` runs as this user (and, given `start`, is the process that started then, not a later one
    that reuses the pid); a zombie, exited but not yet reaped, is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # another user's process has that pid now
        return False
    if start is not None and process_start_time(pid) not in (start, None):
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            if any(line.startswith("State:") and "Z" in line.split()[1] for line in f):
                return False
    except OSError:
        pass
    return True
