"""When each request is sent: offsets in seconds from the start of a run.

A request rate of inf sends everything at once. Otherwise the gaps are gamma-distributed with shape
`burstiness` and mean 1 / rate, as in vLLM: burstiness 1 is a Poisson process, below 1 burstier, above 1
more regular.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidParameterError


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """`n` non-decreasing offsets, the first at 0."""
    if not rate > 0:
        raise InvalidParameterError("request_rate", f"must be > 0 (inf: all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise InvalidParameterError("burstiness", f"must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
