"""Running a user's script as a plain process (`python script.py`), the way the user would run it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600.0          # generous: CI has 2 CPU cores; a hang still fails (the child is killed)


def write_script(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def run_script(path: Path, *args: str, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Runs `python path args…` to its end, from a directory outside the checkout (the installed package is
    what it imports); returns its status and output (text)."""
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, cwd=path.parent,
                          timeout=timeout_s, check=False, env=script_env())


def start_script(path: Path, *args: str) -> subprocess.Popen:
    """Starts `python -u path args…`: its stdout a pipe (text), its stderr (the deployment's logs, which
    could fill a pipe nobody reads) the file `path` + ".stderr"."""
    with open(f"{path}.stderr", "w") as err:
        return subprocess.Popen([sys.executable, "-u", str(path), *args], stdout=subprocess.PIPE, stderr=err,
                                text=True, cwd=path.parent, env=script_env())


def script_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def failed(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"


class Lines:
    """The stdout lines of a started script, read on a thread so that a wait for one can be bounded."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import queue
        import threading

        self.proc = proc
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self._q.put(line.rstrip("\n"))
            self._q.put(None)

        threading.Thread(target=read, daemon=True).start()

    def wait_for(self, tag: str, timeout_s: float) -> str:
        """The rest of the first line that starts with `tag` (and a space); fails after `timeout_s` or at EOF."""
        import queue
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {tag!r} line within {timeout_s:.0f} s; seen: {self.seen[-20:]}") from None
            if line is None:
                err = Path(f"{self.proc.args[2]}.stderr").read_text()
                raise AssertionError(f"the script ended before a {tag!r} line; seen: {self.seen[-20:]}\n{err[-6000:]}")
            self.seen.append(line)
            if line.startswith(tag + " "):
                return line[len(tag) + 1:]
