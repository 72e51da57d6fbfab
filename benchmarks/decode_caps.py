"""Decode attention replayed at a CUDA graph's context cap over shorter contexts: fixed splits against the
splits `split_lengths` chooses, which share each sequence's span evenly where it takes whole waves.

    python -m benchmarks.decode_caps [--copy-tbs 2.96]

A decode graph is captured for a context cap and replayed for every context below it, so the launch's split
count is the cap's while the work is the context's. Llama-3-8B's heads (32 query, 8 KV, head dim 128), bf16
cache in 16-token blocks scattered at random. Each figure is the median of graph replays in microseconds,
beside the share of the floor: the sequences' real K/V bytes over the copy rate (measured, or given).
"""
from __future__ import annotations

import argparse

import torch

from . import ceilings
from .cuda_kernels import timed

BLOCK = 16
CASES = ((1, 32768, 32768), (1, 32768, 20000), (1, 32768, 9000), (1, 8192, 8192), (1, 8192, 3000),
         (4, 32768, 32768), (4, 32768, 12000), (8, 8192, 5000), (64, 512, 500), (64, 2048, 1500))
VARIANTS = (("fixed512", dict(partition=512)), ("auto", {}), ("auto-fixed", dict(min_partition=10 ** 6)))


def main(argv: list[str] | None = None) -> None:
    from mii_async.kernels import decode_attention as DA

    p = argparse.ArgumentParser()
    p.add_argument("--copy-tbs", type=float, default=None, help="copy rate for the floor (default: measured)")
    args = p.parse_args(argv)
    bandwidth = args.copy_tbs * 1e12 if args.copy_tbs else ceilings.copy_bandwidth()
    print(f"copy rate {bandwidth / 1e12:.2f} TB/s; us (share of the context's K/V floor); "
          "auto-fixed = auto's split count without even shares")
    g = torch.Generator(device="cuda").manual_seed(0)
    for seqs, cap, ctx in CASES:
        blocks = -(-cap // BLOCK)
        kc = torch.randn(seqs * blocks + 1, BLOCK, 8, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        tables = torch.randperm(seqs * blocks, device="cuda", generator=g).view(seqs, blocks)
        lens = torch.full((seqs,), ctx, device="cuda")
        q = torch.randn(seqs, 32, 128, device="cuda", dtype=torch.bfloat16)
        floor = 2 * seqs * ctx * 8 * 128 * 2 / bandwidth * 1e6
        ref = DA.paged_attention_decode(q, kc, vc, tables, lens, cap, 0.088, partition=512).float()
        line = f"S={seqs} cap={cap} ctx={ctx} floor {floor:.1f}:"
        for name, kw in VARIANTS:
            out = DA.paged_attention_decode(q, kc, vc, tables, lens, cap, 0.088, **kw).float()
            err = float((out - ref).norm() / ref.norm())
            us = timed(lambda: DA.paged_attention_decode(q, kc, vc, tables, lens, cap, 0.088, **kw))
            line += f" {name} {us:.1f} ({100 * floor / us:.0f}%{'' if err < 1e-2 else ' ERR %.3g' % err})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
