"""examples/stream_client.py against the session's deployment (a real router and worker process)."""
from __future__ import annotations

import re
import socket

from tests.examples.helpers import run_example

PROMPTS = ["The three primary colours are", "def fibonacci(n):", "Once upon a time"]


def test_streams_an_answer_then_runs_prompts_concurrently(deployment):
    """The greedy question streams "Paris" and ends "stop" with its usage; the concurrent part prints one line
    per prompt, each with the deployment's own greedy answer for that prompt, finish_reason and usage."""
    args = ["--router", deployment.address, "--max-new-tokens", "12"]
    for p in PROMPTS:
        args += ["--prompt", p]
    out = run_example("stream_client.py", *args)
    assert out.returncode == 0, out.stderr
    first, _, concurrent = out.stdout.partition(f"{len(PROMPTS)} prompts at once:")
    assert "Paris" in first
    assert re.search(r"\[finish_reason=stop prompt_tokens=\d+ completion_tokens=\d+\]", first), first

    lines = [line for line in concurrent.splitlines() if re.match(r"\[\d+\] ", line)]
    assert len(lines) == len(PROMPTS), concurrent
    expected = deployment(PROMPTS, max_new_tokens=12)
    for i, (line, p, r) in enumerate(zip(lines, PROMPTS, expected, strict=True)):
        assert line.startswith(f"[{i}] finish_reason={r.finish_reason} prompt_tokens={r.prompt_length} "
                               f"completion_tokens={r.generated_length} "), line
        assert line.endswith(f"| {p} … {r.generated_text.strip().replace(chr(10), ' ')}"), line
    assert re.search(rf"all {len(PROMPTS)} in [\d.]+s", concurrent)


def test_unreachable_router_is_a_clear_error():
    """Against a port where nothing listens, the example exits 1 with the client's UnavailableError message
    rather than hanging."""
    with socket.socket() as s:                 # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run_example("stream_client.py", "--router", f"tcp://127.0.0.1:{port}", "--max-new-tokens", "4",
                      "--timeout", "1")
    assert out.returncode == 1 and "router" in out.stderr, (out.stdout, out.stderr)
