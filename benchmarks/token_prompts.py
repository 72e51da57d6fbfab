"""Seeded prompts of random token ids (the benchmarks on random-weight models need no text)."""
from __future__ import annotations

import random


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 128000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
