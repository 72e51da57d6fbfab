"""examples/websocket_chat.py against the session's gateway (a real gateway process in front of the router)."""
from __future__ import annotations

import asyncio
import re
import signal
import subprocess

from tests.examples.helpers import REPO, TIMEOUT_S, example_argv, run_example
from tests.mesh_helpers import kv_idle

USAGE = re.compile(r"\[finish_reason=(\w+) prompt_tokens=(\w+) completion_tokens=(\d+)\]")


def test_once_answers_one_question(gateway_url):
    """`--once` streams the greedy answer to one question over /v1/ws ("Paris"), then the done frame's
    finish_reason "stop" and usage, and exits 0."""
    out = run_example("websocket_chat.py", "--url", gateway_url, "--once", "What is the capital of France?",
                      "--max-new-tokens", "32")
    assert out.returncode == 0, out.stderr
    answer, usage = out.stdout.rstrip("\n").rsplit("\n", 1)
    assert "Paris" in answer
    m = USAGE.fullmatch(usage)
    assert m and m[1] == "stop" and int(m[2]) > 0 and 0 < int(m[3]) < 32, usage


def test_interactive_chat_keeps_the_history(gateway_url):
    """Lines on stdin are turns of one conversation: the second question is sent with the first exchange
    before it (its prompt is longer, and "And what about Germany?" is understood as asking for a capital);
    end of input quits with status 0."""
    out = run_example("websocket_chat.py", "--url", gateway_url, "--max-new-tokens", "32",
                      stdin="What is the capital of France?\nAnd what about Germany?\n")
    assert out.returncode == 0, out.stderr
    turns = out.stdout.split("bot> ")[1:]
    assert len(turns) == 2, out.stdout
    assert "Paris" in turns[0] and "Berlin" in turns[1]
    usages = [USAGE.search(t) for t in turns]
    assert all(u and u[1] == "stop" for u in usages), out.stdout
    first, second = (int(u[2]) for u in usages)
    assert second > first + int(usages[0][3]), "the second turn was not sent with the first exchange"
    assert "[2 messages in the conversation]" in turns[0] and "[4 messages in the conversation]" in turns[1]


def test_ctrl_c_cancels_the_answer(gateway_url, deployment):
    """Ctrl-C (SIGINT) while an answer streams sends a cancel frame: the answer ends at once with
    finish_reason "abort" well short of its 400 tokens, the script exits 0, and the deployment frees the request's KV blocks."""
    proc = subprocess.Popen(example_argv("websocket_chat.py", "--url", gateway_url, "--once",
                                         "Tell me a very long story about a dragon.", "--max-new-tokens", "400"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.read(1), "no token came"             # the answer has started streaming
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    m = USAGE.search(out)
    assert m and m[1] == "abort" and int(m[3]) < 400, out
    asyncio.run(kv_idle(deployment))


def test_forgets_the_oldest_turn_when_the_conversation_outgrows_the_context(gateway_url, deployment):
    """Two long questions that fit the deployment one at a time but not together: the second is answered after
    the first turn is forgotten (said on stdout), not refused, and the conversation goes on from there."""
    limits = deployment.run(deployment.health())["limits"]
    tokens = min(limits["max_model_len"], limits["max_request_tokens"]) * 3 // 5
    long_q = "The quick brown fox jumps over the lazy dog. " * (tokens // 10) + "Who is lazy?"   # 10 tokens each
    out = run_example("websocket_chat.py", "--url", gateway_url, "--max-new-tokens", "8",
                      stdin=f"{long_q}\n{long_q}\nThanks!\n")
    assert out.returncode == 0, out.stderr
    assert "error" not in out.stderr, out.stderr
    turns = out.stdout.split("you> ")[1:]
    assert len(turns) == 4, out.stdout                       # three questions, then the end of input
    assert "forgotten" not in turns[0] and "[2 messages in the conversation]" in turns[0]
    assert "[the oldest turn was forgotten: the conversation outgrew the context]" in turns[1]
    assert USAGE.search(turns[1]) and "[2 messages in the conversation]" in turns[1]
    assert "forgotten" not in turns[2] and "[4 messages in the conversation]" in turns[2]
