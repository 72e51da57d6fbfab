"""Serving metrics from request records, with vLLM's `bench serve` definitions so figures compare:

- TTFT: first chunk with tokens − send time. E2E latency (e2el): last frame − send time.
- TPOT: (e2el − TTFT) / (output tokens − 1), per request with more than one output token.
- ITL: the gaps between successive chunks of a request (a chunk of several tokens is one gap, as in vLLM).
- Throughputs divide by the run's duration: first send to last frame.
- Goodput (`--goodput ttft:MS tpot:MS e2el:MS`): completed requests that meet every SLO given, per second.

And DeepSpeed-FastGen's effective throughput: a request meets the SLA when its TTFT is at most
prompt tokens / 512 s, and the exponential moving average (pandas' `ewm(span)`, adjusted) of its per-token
generation latency stays below 1 / R s for a generation SLA of R tokens/s (2, 4 and 6, a slow, an average and
a fast reader). A chunk of k tokens after a gap g counts as k tokens of g / k each. Effective throughput is
the requests that meet the SLA per second of the run.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import InvalidParameterError
from .targets import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")
FASTGEN_PROMPT_TOKENS_S = 512.0
FASTGEN_GEN_SLAS = (2.0, 4.0, 6.0)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] → {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise InvalidParameterError("goodput", f"{item!r}: the metric must be one of {', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise InvalidParameterError("goodput", f"{item!r}: the value must be milliseconds, e.g. ttft:500") from None
        if not slos[name] > 0:
            raise InvalidParameterError("goodput", f"{item!r}: the value must be > 0")
    return slos


def _ema_ok(gaps: list[float], tokens: list[int], rate: float, span: int) -> bool:
    per_token = [g / k for g, k in zip(gaps, tokens) for _ in range(k)]
    if not per_token:
        return True
    alpha, num, den = 2.0 / (span + 1.0), 0.0, 0.0
    for x in per_token:                         # adjusted EWM: weights (1 − α)^i over the samples so far
        num = x + (1 - alpha) * num
        den = 1 + (1 - alpha) * den
        if num / den >= 1.0 / rate:
            return False
    return True


def _stats(name: str, xs_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs_s, dtype=float) * 1000.0 if xs_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
           f"std_{name}_ms": float(a.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(a, p))
    return out


def summarize(records: list[RequestRecord], t0: float, *, goodput: dict[str, float] | None = None,
              percentiles: Sequence[float] = (50, 90, 99), ema_span: int = 16) -> dict[str, Any]:
    """The run's figures (times in ms, throughputs per second), as a flat dict."""
    done = [r for r in records if r.ok]
    end = max((r.end for r in records), default=t0)
    duration = max(end - t0, 1e-9)
    ttft, tpot, itl, e2el = [], [], [], []
    good = 0
    fastgen = {rate: 0 for rate in FASTGEN_GEN_SLAS}
    for r in done:
        first = (r.chunk_times[0] if r.chunk_times else r.end) - r.start
        lat = r.end - r.start
        gaps = [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]
        ttft.append(first)
        e2el.append(lat)
        itl.extend(gaps)
        t = (lat - first) / (r.output_tokens - 1) if r.output_tokens > 1 else None
        if t is not None:
            tpot.append(t)
        per = {"ttft": first, "tpot": t or 0.0, "e2el": lat}
        if goodput and all(per[k] * 1000.0 <= v for k, v in goodput.items()):
            good += 1
        if first <= r.prompt_len / FASTGEN_PROMPT_TOKENS_S:
            # Without per-chunk counts (OpenAI text chunks), the tokens are spread evenly over the chunks.
            counts = r.chunk_tokens[1:] if r.chunk_tokens is not None else _spread(r.output_tokens - 1, len(gaps))
            for rate in FASTGEN_GEN_SLAS:
                fastgen[rate] += _ema_ok(gaps, counts, rate, ema_span)
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    cached = [r.cached_tokens for r in done]
    streamed = [r.streamed_tokens for r in done]
    out: dict[str, Any] = {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "total_cached_prompt_tokens": None if any(c is None for c in cached) else sum(cached),
        "total_streamed_tokens": None if any(s is None for s in streamed) else sum(streamed),
        "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if goodput:
        out["request_goodput"] = good / duration
        out["goodput_slos_ms"] = dict(goodput)
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        out.update(_stats(name, xs, percentiles))
    out["fastgen_prompt_sla_tokens_s"] = FASTGEN_PROMPT_TOKENS_S
    out["fastgen_ema_span"] = ema_span
    for rate, n in fastgen.items():
        out[f"fastgen_effective_throughput_{rate:g}tok_s"] = n / duration
        out[f"fastgen_sla_met_fraction_{rate:g}tok_s"] = n / len(done) if done else 0.0
    out["errors"] = sorted({r.error for r in records if r.error})[:10]
    return out


def _spread(tokens: int, chunks: int) -> list[int]:
    if chunks <= 0:
        return []
    base, extra = divmod(max(tokens, chunks), chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def tokens_over_time(records: list[RequestRecord], t0: float, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens per second in bins of `bin_s` seconds from the start: (bin starts, rates)."""
    stamps: list[tuple[float, int]] = []
    for r in records:
        if not r.ok:
            continue
        counts = r.chunk_tokens if r.chunk_tokens is not None else _spread(r.output_tokens, len(r.chunk_times))
        stamps.extend((t - t0, k) for t, k in zip(r.chunk_times, counts))
    if not stamps:
        return [], []
    n = int(max(t for t, _ in stamps) // bin_s) + 1
    bins = [0.0] * n
    for t, k in stamps:
        bins[int(t // bin_s)] += k
    return [i * bin_s for i in range(n)], [b / bin_s for b in bins]
