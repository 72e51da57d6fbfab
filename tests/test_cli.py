"""The `mii-async` command, run as a real process."""
from __future__ import annotations

import subprocess
import sys


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mii_async", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_generate_streams_the_answer(default_model_dir):
    """`mii-async generate` streams the default model's chat answer to stdout."""
    out = _cli("generate", "What is the capital of France?", "--max-new-tokens", "32")
    assert out.returncode == 0, out.stderr
    assert "The capital of France is Paris." in out.stdout


def test_bad_option_is_a_clear_error():
    """A bad sampling option exits 2 with a message naming it, before any model loads."""
    out = _cli("generate", "hi", "--temperature", "-1")
    assert out.returncode == 2 and "temperature" in out.stderr and "loading" not in out.stderr
