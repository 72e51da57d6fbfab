"""What the served-deployment benchmarks (multi_gpu.py, llama70b_fp8.py) measure through a client of `serve()`:
random token-id prompts, the batch-1 decode step as the gap between streamed tokens, and an offline load's
output tokens/s."""
from __future__ import annotations

import random
import statistics
import time
from typing import Any


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def bs1_ms_per_step(client: Any, vocab: int, tokens: int = 128) -> float:
    """The median gap between streamed tokens of one request after a 128-token prompt (a warm-up run first)."""
    p = prompts(1, 128, vocab, 3)[0]

    async def one() -> list[float]:
        times = []
        async for _ in client.stream(p, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1):
            times.append(time.perf_counter())
        return times

    client.run(one())
    t = client.run(one())
    return 1e3 * statistics.median(y - x for x, y in zip(t[1:], t[2:]))


def offline(client: Any, vocab: int, requests: int) -> dict[str, float]:
    """`requests` requests of 128 in / 128 out, all at once: output tokens/s and the seconds it took."""
    ps = prompts(requests, 128, vocab, 4)
    t0 = time.perf_counter()
    res = client(ps, max_new_tokens=128, min_new_tokens=128)
    secs = time.perf_counter() - t0
    toks = sum(len(r.token_ids) for r in res)
    assert toks == 128 * len(ps), f"{toks} tokens streamed, {128 * len(ps)} asked"
    return {"offline_output_tok_s": toks / secs, "offline_seconds": secs}
