"""Running an example script of examples/ as a real process, the way a user would."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 120.0            # generous: CI has 2 CPU cores; a hang still fails (subprocess.run kills the child)


def example_argv(name: str, *args: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / name), *args]


def run_example(name: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Runs examples/<name> to its end; returns its exit status and output (text)."""
    return subprocess.run(example_argv(name, *args), input=stdin, capture_output=True, text=True, cwd=REPO,
                          timeout=TIMEOUT_S, check=False)
