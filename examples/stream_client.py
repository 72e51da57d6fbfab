"""Stream answers from a running deployment with `mii_async.client`.

Start a deployment in another terminal (the router listens on tcp://127.0.0.1:5555 by default):

    .venv/bin/mii-async serve

then run:

    .venv/bin/python examples/stream_client.py --router tcp://127.0.0.1:5555

First one chat answer streams token by token (`async for piece in client.stream(...)`); then several prompts
run at once, one task each, joined with `asyncio.gather`, and each prints its finish_reason and usage. The
router batches concurrent requests together (continuous batching), so all of them take about as long as the
slowest one rather than the sum.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import NamedTuple

import mii_async

QUESTION = "What is the capital of France?"
PROMPTS = ["The three primary colours are", "A haiku about the sea:", "def fibonacci(n):"]


class Answer(NamedTuple):
    prompt: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float            # time to the first token
    total_s: float           # time to the last


async def stream_one(client: mii_async.AsyncClient, question: str, max_new_tokens: int) -> None:
    """Streams one chat answer to stdout as it is sampled."""
    messages = [{"role": "user", "content": question}]     # a chat prompt: the model's chat template applies
    print(f"> {question}")
    async for piece in client.stream(messages, max_new_tokens=max_new_tokens, temperature=0):
        print(piece.text, end="", flush=True)
        if piece.finish_reason is not None:               # only the last piece has finish_reason and usage
            print()
            if piece.finish_reason == "error":            # the replica failed mid-request
                print(f"[error: {piece.error}]", file=sys.stderr)
            u = piece.usage
            tokens = f"prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens}" if u else "no usage"
            print(f"[finish_reason={piece.finish_reason} {tokens}]")


async def answer(client: mii_async.AsyncClient, prompt: str, max_new_tokens: int) -> Answer:
    """One prompt, streamed and collected; records time to the first token."""
    start = time.perf_counter()
    ttft = 0.0
    parts: list[str] = []
    last: mii_async.StreamChunk | None = None
    async for piece in client.stream(prompt, max_new_tokens=max_new_tokens, temperature=0):
        if last is None:
            ttft = time.perf_counter() - start
        parts.append(piece.text)
        last = piece
    assert last is not None and last.finish_reason is not None, "a stream always ends with a finish_reason"
    u = last.usage
    return Answer(prompt, "".join(parts), last.finish_reason, u.prompt_tokens if u else 0,
                  u.completion_tokens if u else 0, ttft, time.perf_counter() - start)


async def run(router: str, question: str, prompts: list[str], max_new_tokens: int, timeout_s: float) -> None:
    # Connecting is lazy: an unreachable router shows as UnavailableError on the first request, after
    # timeout_s; so does a router that stops answering for that long while requests are outstanding.
    client = mii_async.client(router, timeout_s=timeout_s)
    try:
        await stream_one(client, question, max_new_tokens)

        print(f"\n{len(prompts)} prompts at once:")
        start = time.perf_counter()
        # Each coroutine is its own request; any number may share one client. If one raises, gather
        # raises it at once while the others go on; asyncio.run then cancels them on the way out, and a
        # cancelled stream aborts its request on the server.
        answers = await asyncio.gather(*(answer(client, p, max_new_tokens) for p in prompts))
        for i, a in enumerate(answers):
            text = a.text.strip().replace("\n", " ")
            print(f"[{i}] finish_reason={a.finish_reason} prompt_tokens={a.prompt_tokens} "
                  f"completion_tokens={a.completion_tokens} ttft={a.ttft_s:.2f}s total={a.total_s:.2f}s "
                  f"| {a.prompt} … {text}")
        print(f"all {len(prompts)} in {time.perf_counter() - start:.2f}s "
              f"(their own times add up to {sum(a.total_s for a in answers):.2f}s: they ran at once)")
    finally:
        client.close()        # drops our socket; the deployment keeps running


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="tcp://127.0.0.1:5555", help="the router's client address")
    p.add_argument("--question", default=QUESTION, help="the question streamed first")
    p.add_argument("--prompt", action="append", default=None, dest="prompts",
                   help="a prompt for the concurrent part (repeatable; default: three built-in ones)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an unreachable or silent router")
    a = p.parse_args(argv)
    try:
        asyncio.run(run(a.router, a.question, a.prompts or PROMPTS, a.max_new_tokens, a.timeout))
    except mii_async.MIIAsyncError as exc:      # e.g. the router is unreachable, or a bad parameter
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
