"""Prompt attention over the paged cache: torch's varlen flash attention against the cuDNN frontend's graphs.

    python -m benchmarks.prompt_attention

Each case is one step's prompt chunks (query lengths) over their contexts (chunk included), with Llama-3-8B's
heads (32 query, 8 KV, head dim 128), bf16, the cache's 16-token blocks scattered at random; one-token rows are
decodes, which this op leaves out. Each figure is the median of 10 CUDA-event timings of the op (eager, as a
prompt step runs it), its causal FLOPs over that time, and the first call's seconds (cuDNN builds its graph for
the step's bucket there). `rel` is the relative difference of the two outputs.
"""
from __future__ import annotations

import time

import torch

from .gemm_tiles import timer

BLOCK = 16
POOL_BLOCKS = 25000
CASES = (([1800], [7900]), ([2048], [2048]), ([2048], [32000]), ([512] * 4, [4000, 5000, 6000, 7000]),
         ([1] * 64 + [1500], [6000] * 65))


def _metadata(qlens, clens, tables):
    from mii_async.kernels.metadata import AttentionMetadata

    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    decodes = next((i for i, n in enumerate(qlens) if n != 1), len(qlens))
    return AttentionMetadata(torch.zeros(sum(qlens), dtype=torch.int64, device="cuda"), tables,
                             torch.tensor(clens, device="cuda"), torch.tensor(starts, device="cuda"), decodes,
                             max(clens), list(qlens), list(clens))


def main() -> None:
    from mii_async.kernels import cuda as K
    from mii_async.kernels.config import KernelConfig

    median_s = timer(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(POOL_BLOCKS, BLOCK, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    print("ms (TFLOP/s), flash vs cudnn; first call (cuDNN's graph build) s")
    for qlens, clens in CASES:
        need = [-(-c // BLOCK) for c in clens]
        perm = torch.randperm(POOL_BLOCKS, device="cuda", generator=g)
        tables = torch.zeros(len(clens), max(need), dtype=torch.int64, device="cuda")
        at = 0
        for i, n in enumerate(need):
            tables[i, :n] = perm[at:at + n]
            at += n
        q = torch.randn(sum(qlens), 32, 128, device="cuda", dtype=torch.bfloat16)
        meta = _metadata(qlens, clens, tables)
        flops = sum(4 * 32 * 128 * ql * (c - ql + (ql + 1) / 2) for ql, c in zip(qlens, clens) if ql > 1)
        outs, line = {}, f"q={qlens[-4:]} c={clens[-4:]}:"
        for kern in ("flash", "cudnn"):
            cfg = KernelConfig(prefill_attention=kern)
            t0 = time.perf_counter()
            outs[kern] = K.paged_attention(q, kc, vc, meta, 0.088, config=cfg)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            ms = median_s(lambda: K.paged_attention(q, kc, vc, meta, 0.088, config=cfg), 10) * 1e3
            line += f" {kern} {ms:.3f} ms ({flops / ms / 1e9:.0f} TF/s, first {first:.2f} s)"
        a, b = outs["flash"][meta.num_decodes:].float(), outs["cudnn"][meta.num_decodes:].float()
        print(line + f" rel {float((a - b).norm() / a.norm()):.2e}", flush=True)


if __name__ == "__main__":
    main()
