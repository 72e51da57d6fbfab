"""Times each CUDA kernel beside its torch reference on the GPU, and against the bandwidth floor.

    python -m benchmarks.cuda_kernels [--dtype bfloat16]

Shapes are Llama-3-8B's (hidden 4096, 32 query heads, 8 KV heads, head dim 128, ffn 14336). Each figure is the
median of CUDA-event timings of graph replays (GPU time, no launch cost); the floor is the bytes the op must
move / the card's device-to-device copy rate, measured first (ceilings.py; the H200's: 4.25 TB/s).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from . import ceilings
from .graph_replay import capture

BANDWIDTH = 4.25e12      # the H200's; main() measures the card's own


def timed(fn, reps: int = 20) -> float:
    """Median microseconds of one fn() on the GPU: `reps` calls captured in a CUDA graph (so that host launch
    cost is left out, as in the engine's decode graphs), replayed after warm-up."""
    graph = capture(fn, reps)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    from mii_async.kernels import cuda as K
    from mii_async.kernels import reference as R
    from mii_async.kernels.metadata import AttentionMetadata

    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args(argv)
    global BANDWIDTH
    BANDWIDTH = ceilings.copy_bandwidth()
    print(f"this card: copy {BANDWIDTH / 1e12:.2f} TB/s (the floors below)")
    dt = getattr(torch, a.dtype)
    es = torch.tensor([], dtype=dt).element_size()
    rows = []
    for t in (1, 64, 2048):
        x = torch.randn(t, 4096, device="cuda", dtype=dt)
        res, w = torch.randn_like(x), torch.ones(4096, device="cuda", dtype=dt)
        floor = 4 * t * 4096 * es / BANDWIDTH * 1e6
        rows.append((f"fused_add_rms_norm T={t}", timed(lambda: K.fused_add_rms_norm(x, res, w, 1e-5)),
                     timed(lambda: R.fused_add_rms_norm(x, res, w, 1e-5)), floor))
        g = torch.randn(t, 2 * 14336, device="cuda", dtype=dt)
        floor = 3 * t * 14336 * es / BANDWIDTH * 1e6
        rows.append((f"silu_and_mul T={t}", timed(lambda: K.silu_and_mul(g)), timed(lambda: R.silu_and_mul(g)), floor))
    bs = 16
    # (sequences, shortest, longest context): full contexts, then random ones over shuffled blocks (the
    # mixed benchmark's decodes hold 64 … 1536 tokens)
    cases = ((1, 128, 128), (1, 4096, 4096), (1, 32768, 32768), (16, 1024, 1024), (64, 1024, 1024),
             (256, 512, 512), (128, 512, 1024), (256, 512, 1024), (256, 64, 1536))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for s, lo, hi in cases:
        nb = -(-hi // bs)
        kc = torch.randn(s * nb + 1, bs, 8, 128, device="cuda", dtype=dt)
        vc = torch.randn_like(kc)
        tables = torch.randperm(s * nb, device="cuda", generator=gen).view(s, nb)
        lens = torch.randint(lo, hi + 1, (s,), device="cuda", generator=gen)
        q = torch.randn(s, 32, 128, device="cuda", dtype=dt)
        meta = AttentionMetadata(torch.zeros(s, dtype=torch.int64, device="cuda"), tables, lens,
                                 torch.arange(s + 1, device="cuda"), s, hi, [1] * s, lens.tolist())
        floor = 2 * int(lens.sum()) * 8 * 128 * es / BANDWIDTH * 1e6
        ref_us = timed(lambda: R.paged_attention(q, kc, vc, meta, 0.088))
        ctx = f"{lo}" if lo == hi else f"{lo}-{hi}"
        rows.append((f"decode attention S={s} ctx={ctx}", timed(lambda: K.paged_attention(q, kc, vc, meta, 0.088)),
                     ref_us, floor))
        for kern, warps in (("split", None), ("stream", None), ("mma", 4), ("mma", 2)):
            name = kern if warps is None else f"{kern}/{warps} warps"
            for part in (None, 128, 256, 512, 1024, 2048):
                rows.append((f"  {name} partition {part or 'auto'}", timed(lambda: K.paged_attention_decode(
                    q, kc, vc, tables, lens, hi, 0.088, partition=part, kernel=kern, warps=warps)), ref_us, floor))
            # the other grid order: the blocks running at once are one KV head of many sequences
            rows.append((f"  {name} auto, seq-major grid", timed(lambda: K.paged_attention_decode(
                q, kc, vc, tables, lens, hi, 0.088, kernel=kern, warps=warps, grid="sequences")), ref_us, floor))
    print(f"{'op (' + a.dtype + ')':<36}{'cuda µs':>10}{'torch µs':>10}{'floor µs':>10}{'% of floor':>12}")
    for name, ours, ref, floor in rows:
        print(f"{name:<36}{ours:>10.1f}{ref:>10.1f}{floor:>10.2f}{100 * floor / ours:>11.0f}%")


if __name__ == "__main__":
    main()
