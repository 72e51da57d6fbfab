"""PNG figures of a benchmark through matplotlib (the Agg backend: no display needed).

- latency_cdf.png: the CDFs of TTFT, TPOT, ITL and E2E latency of one run;
- tokens_over_time.png: output tokens per second over the run, in one-second bins;
- sweep.png: over a sweep of request rates, latency against throughput (the shape of DeepSpeed-FastGen's
  throughput-latency figures) and effective throughput against the rate.
"""
from __future__ import annotations

import math
import os
from typing import Any

from ..errors import InvalidParameterError
from .metrics import FASTGEN_GEN_SLAS, tokens_over_time
from .targets import RequestRecord


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise InvalidParameterError("plot_dir", "plots need matplotlib: pip install 'mii-async[bench]' "
                                    "(or leave out --plot-dir)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, xs: list[float], title: str) -> None:
    xs = sorted(xs)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(True, alpha=0.3)


def run_figures(records: list[RequestRecord], t0: float, out_dir: str, tag: str) -> list[str]:
    """The two figures of one run; returns their paths."""
    plt = _plt()
    os.makedirs(out_dir, exist_ok=True)
    ok = [r for r in records if r.ok]
    ttft = [((r.chunk_times[0] if r.chunk_times else r.end) - r.start) * 1e3 for r in ok]
    e2el = [(r.end - r.start) * 1e3 for r in ok]
    tpot = [(e - f) / (r.output_tokens - 1) for r, e, f in zip(ok, e2el, ttft) if r.output_tokens > 1]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, xs, title in zip(axes.flat, (ttft, tpot, itl, e2el), ("TTFT", "TPOT", "ITL", "E2E latency")):
        _cdf(ax, xs, title)
    fig.suptitle(f"latency CDFs ({tag})")
    fig.tight_layout()
    cdf_path = os.path.join(out_dir, f"latency_cdf{_suffix(tag)}.png")
    fig.savefig(cdf_path, dpi=100)
    plt.close(fig)
    starts, rates = tokens_over_time(records, t0)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.step(starts, rates, where="post")
    ax.set_xlabel("seconds since the start")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"output tokens per second ({tag})", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    tps_path = os.path.join(out_dir, f"tokens_over_time{_suffix(tag)}.png")
    fig.savefig(tps_path, dpi=100)
    plt.close(fig)
    return [cdf_path, tps_path]


def sweep_figure(results: list[dict[str, Any]], out_dir: str) -> str:
    """Latency vs throughput, one point per request rate, and effective throughput vs the rate."""
    plt = _plt()
    os.makedirs(out_dir, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    results = sorted(results, key=lambda r: r["request_rate"])
    qps = [r["request_throughput"] for r in results]
    for key, label in (("median_e2el_ms", "E2E p50"), ("p90_e2el_ms", "E2E p90"), ("median_ttft_ms", "TTFT p50")):
        if all(key in r for r in results):
            left.plot(qps, [r[key] / 1e3 for r in results], marker="o", label=label)
    left.set_xlabel("throughput (requests / s)")
    left.set_ylabel("latency (s)")
    left.set_title("latency against throughput", fontsize=10)
    left.legend()
    left.grid(True, alpha=0.3)
    finite = [r["request_rate"] for r in results if math.isfinite(r["request_rate"])]
    inf_at = max(finite) * 1.5 if finite else 1.0
    rates = [r["request_rate"] if math.isfinite(r["request_rate"]) else inf_at for r in results]
    for sla in FASTGEN_GEN_SLAS:
        right.plot(rates, [r[f"fastgen_effective_throughput_{sla:g}tok_s"] for r in results], marker="o",
                   label=f"effective, {sla:g} tok/s SLA")
    right.plot(rates, qps, marker="x", linestyle="--", label="all completed")
    right.set_xlabel("request rate (requests / s; inf drawn at the right)")
    right.set_ylabel("requests / s")
    right.set_title("effective throughput (prompt SLA 512 tok/s)", fontsize=10)
    right.legend(fontsize=8)
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, "sweep.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _suffix(tag: str) -> str:
    return "_" + "".join(c if c.isalnum() or c in ".-" else "_" for c in tag) if tag else ""
