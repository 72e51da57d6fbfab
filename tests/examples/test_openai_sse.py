"""examples/openai_sse.py against the session's gateway: /v1/chat/completions streamed as SSE with httpx."""
from __future__ import annotations

import re

from tests.examples.helpers import run_example

QUESTION = "What is the capital of France?"


def test_streams_the_chat_completion(gateway_url, deployment):
    """The deltas printed are the deployment's own greedy chat answer ("Paris"), followed by the last chunk's
    finish_reason "stop" and the include_usage chunk's token counts."""
    out = run_example("openai_sse.py", "--url", gateway_url, "--max-tokens", "32", QUESTION)
    assert out.returncode == 0, out.stderr
    answer, usage = out.stdout.rstrip("\n").rsplit("\n", 1)
    [expected] = deployment([{"role": "user", "content": QUESTION}], max_new_tokens=32)
    assert answer == expected.generated_text and "Paris" in answer
    assert usage == (f"[finish_reason=stop prompt_tokens={expected.prompt_length} "
                     f"completion_tokens={expected.generated_length}]"), usage


def test_refused_request_prints_the_servers_error(gateway_url):
    """A request refused before any event (an unknown model: HTTP 404) exits 1 with the server's message
    naming the parameter, and prints no answer."""
    out = run_example("openai_sse.py", "--url", gateway_url, "--model", "no-such-model", QUESTION)
    assert out.returncode == 1 and out.stdout == ""
    assert re.search(r"HTTP 404: .*no-such-model.*\(parameter model\)", out.stderr), out.stderr
