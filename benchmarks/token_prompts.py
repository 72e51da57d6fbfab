"""Seeded prompts of random token ids (the benchmarks on random-weight models need no text)."""
from __future__ import annotations

import random


def prompts(n: int, lo: int, hi: int, seed: int, ids: tuple[int, int] = (1000, 128000)) -> list[list[int]]:
    """n prompts of lo–hi tokens drawn from ids [first, last) (the default stays below the Llama-3 vocabulary's
    special tokens, 128,000 on)."""
    rng = random.Random(seed)
    return [[rng.randrange(*ids) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
