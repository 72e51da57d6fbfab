"""A batch-1 decode step's projections back to back, as the model launches them, for each L2 prefetch size of
the skinny GEMMs (KernelConfig.gemv_prefetch): 32 Llama-3-8B-shape layers of qkv (after the input norm), o,
gate|up (after the post-attention norm, SiLU-and-mul in the epilogue) and down, in bf16 and over per-channel
FP8 weights, captured in one CUDA graph with programmatic dependent launch.

    python -m benchmarks.gemv_chain [--layers 32] [--prefetch 0,16384,65536,262144] [--repeats 30]

Each kernel's blocks may ask L2 for their first rows before they wait on the kernel ahead; this measures what
that does to the chain: µs per step against the weights' bytes over the card's copy rate (measured first).
Attention, rotary and the LM head are left out, so the share is the projections' alone. Inputs are fixed rows
rather than each kernel's output: a kernel still waits for the one ahead, so the timing is the model's.
"""
from __future__ import annotations

import argparse

import torch

from mii_async.kernels import get_ops
from mii_async.kernels.config import KernelConfig
from mii_async.kernels.fp8_weight import FP8Weight, quantize_weight

from .ceilings import copy_bandwidth
from .gemm_tiles import timer
from .graph_replay import capture

HIDDEN, FFN = 4096, 14336
SHAPES = (("qkv", 6144, HIDDEN), ("o", HIDDEN, HIDDEN), ("gate_up", 2 * FFN, HIDDEN), ("down", HIDDEN, FFN))


def _layers(n: int, fp8: bool) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(n):
        layer = {}
        for name, rows, cols in SHAPES:
            w = (torch.randn(rows, cols, device="cuda", generator=g) / cols ** 0.5).bfloat16()
            layer[name] = quantize_weight(w) if fp8 else w
        layers.append(layer)
    return layers


def _nbytes(w) -> int:
    return w.nbytes if isinstance(w, FP8Weight) else w.numel() * w.element_size()


def step_seconds(layers: list[dict], prefetch: int, repeats: int) -> float:
    """Median seconds of one replay of the whole chain, captured with this prefetch size."""
    ops = get_ops("cuda", KernelConfig(gemv_prefetch=prefetch))
    x, x_ffn = torch.randn(1, HIDDEN, device="cuda").bfloat16(), torch.randn(1, FFN, device="cuda").bfloat16()
    residual, norm_w = torch.randn_like(x), torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        for layer in layers:
            ops.add_rms_norm_linear(x, residual, norm_w, 1e-5, layer["qkv"])
            ops.linear(x, layer["o"])
            ops.add_rms_norm_gate_up(x, residual, norm_w, 1e-5, layer["gate_up"])
            ops.linear(x_ffn, layer["down"])

    return timer(torch.device("cuda"))(capture(step).replay, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prefetch", default="0,16384,65536,262144", help="comma-separated bytes a block asks L2 for")
    ap.add_argument("--repeats", type=int, default=30, help="timed replays per figure (median)")
    a = ap.parse_args()
    sizes = [int(p) for p in a.prefetch.split(",")]
    if a.layers < 1 or any(p < 0 for p in sizes):
        ap.error("--layers must be >= 1 and every --prefetch size >= 0")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gemv_chain needs a CUDA GPU")
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s")
    for fp8 in (True, False):
        layers = _layers(a.layers, fp8)
        nbytes = sum(_nbytes(w) for layer in layers for w in layer.values())
        for p in sizes:
            s = step_seconds(layers, p, a.repeats)
            print(f"{'fp8' if fp8 else 'bf16':<5} prefetch {p:>8}: {s * 1e6:8.1f} µs a step, floor "
                  f"{nbytes / bandwidth * 1e6:8.1f} µs, {nbytes / bandwidth / s:6.1%} of the copy rate")
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
