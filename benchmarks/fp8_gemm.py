"""The projections of one Llama-3-8B layer in bf16 and over FP8 weights, as the model calls them (qkv after the
input norm, o, gate|up after the post-attention norm with SiLU-and-mul, down), at M rows of a step.

    python -m benchmarks.fp8_gemm [--rows 1,2,4,8,64,2048] [--scales channel,block] [--repeats 50] [--json out.json]

For each projection and M: the median time of the op replayed from a CUDA graph (ten calls a graph, as the
decode graphs chain them) in bf16 (gemv.cu at one or two rows, cuBLAS beyond) and over FP8 weights with
per-channel or [128, 128] block scales (gemv_fp8.cu up to FP8_GEMV_MAX_M rows, then the activations quantized
and torch._scaled_mm), and cuBLAS's own FP8 GEMM on pre-quantized activations beside them (what a decode step
would get without gemv_fp8.cu). Against the card's ceilings measured in the same run (ceilings.py: the copy
bandwidth, the bf16 matmul rate; and here the e4m3 _scaled_mm rate at 8192³): at small M the weight bytes
streamed per second (TB/s, and their share of the copy bandwidth, which is the floor of a step that reads each
weight once), at large M the TFLOP/s and their share of the matmul rates.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch

from mii_async.kernels import cuda, fp8_linear, get_ops
from mii_async.kernels.config import KernelConfig
from mii_async.kernels.fp8_weight import FP8Weight, block_rows, quantize_activations, quantize_blocks, quantize_weight

from .ceilings import _median_seconds, copy_bandwidth, matmul_flops
from .gemm_tiles import timer
from .graph_replay import capture

HIDDEN, FFN = 4096, 14336
PROJECTIONS = [("qkv", 6144, HIDDEN), ("o", HIDDEN, HIDDEN), ("gate_up", 2 * FFN, HIDDEN), ("down", HIDDEN, FFN)]
CALLS = 10                      # op calls captured in one graph: a replay's launch cost spread over them


def fp8_matmul_flops(n: int = 8192, runs: int = 20) -> float:
    """e4m3 FLOP/s of an n³ torch._scaled_mm with row-wise scales into bf16."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    return 2 * n ** 3 / _median_seconds(
        lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), runs)


def fp8_weight(w: torch.Tensor, scales: str) -> FP8Weight:
    if scales == "channel":
        return quantize_weight(w)
    q, blocks = quantize_blocks(w)
    return FP8Weight(q, block_rows(blocks, 0, w.shape[0]))


def graph_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of one fn() replayed from a CUDA graph of CALLS calls."""
    graph = capture(fn, CALLS)
    seconds = timer(torch.device("cuda"))(graph.replay, repeats) / CALLS
    del graph
    return seconds


def projection_op(ops, name: str, x: torch.Tensor, weight, norm_w: torch.Tensor,
                  residual: torch.Tensor) -> Callable[[], object]:
    if name == "qkv":
        return lambda: ops.add_rms_norm_linear(x, residual, norm_w, 1e-5, weight)
    if name == "gate_up":
        return lambda: ops.add_rms_norm_gate_up(x, residual, norm_w, 1e-5, weight)
    return lambda: ops.linear(x, weight)


def probe(rows: list[int], scales: list[str], repeats: int, bandwidth: float, bf16_peak: float,
          fp8_peak: float) -> list[dict]:
    ops = get_ops("cuda", KernelConfig.from_env(os.environ))    # the engine's $MII_ASYNC_* choices
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, n, k in PROJECTIONS:
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        variants: list[tuple[str, object]] = [("bf16", w)] + [(f"fp8-{s}", fp8_weight(w, s)) for s in scales]
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            residual = torch.randn_like(x)
            for label, weight in variants:
                seconds = graph_seconds(projection_op(ops, name, x, weight, norm_w, residual), repeats)
                gemv = fp8_linear.gemv_ok(x, weight) if isinstance(weight, FP8Weight) else cuda._gemv_ok(x, weight, k)
                out.append(_row(name, m, n, k, label, "gemv" if gemv else "gemm", seconds, weight, bandwidth,
                                bf16_peak, fp8_peak))
            q, sx = quantize_activations(x)                  # cuBLAS's FP8 GEMM alone, activations ready
            wq = variants[1][1] if scales and scales[0] == "channel" else quantize_weight(w)
            seconds = graph_seconds(lambda: torch._scaled_mm(q, wq.weight.t(), scale_a=sx[:, None],
                                                             scale_b=wq.scale[None, :], out_dtype=torch.bfloat16),
                                    repeats)
            out.append(_row(name, m, n, k, "cublas-fp8", "cublas", seconds, wq, bandwidth, bf16_peak, fp8_peak))
        del variants, w
        torch.cuda.empty_cache()
    return out


def _row(name: str, m: int, n: int, k: int, label: str, path: str, seconds: float, weight, bandwidth: float,
         bf16_peak: float, fp8_peak: float) -> dict:
    nbytes = weight.nbytes if isinstance(weight, FP8Weight) else weight.numel() * weight.element_size()
    flops = 2 * m * n * k
    peak = bf16_peak if label == "bf16" else fp8_peak
    return {"projection": name, "rows": m, "n": n, "k": k, "weights": label, "us": seconds * 1e6,
            "weight_bytes": nbytes, "weight_tb_s": nbytes / seconds / 1e12, "of_copy": nbytes / seconds / bandwidth,
            "floor_us": nbytes / bandwidth * 1e6, "tflop_s": flops / seconds / 1e12, "of_peak": flops / seconds / peak,
            "path": path}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,64,2048",
                    help="comma-separated rows M of a step (2 and 4: where the FP8 GEMV meets _scaled_mm)")
    ap.add_argument("--scales", default="channel,block", help="FP8 weight scales: channel, block or both")
    ap.add_argument("--repeats", type=int, default=50, help="timed graph replays per figure (median)")
    ap.add_argument("--json", help="write the rows and the card's ceilings here")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if any(r <= 0 for r in rows):
        ap.error("--rows: every row count must be positive")
    scales = args.scales.split(",")
    if unknown := [s for s in scales if s not in ("channel", "block")]:
        ap.error(f"--scales: unknown {', '.join(unknown)}; known: channel, block")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.fp8_gemm needs a CUDA GPU")
    bandwidth, bf16_peak, fp8_peak = copy_bandwidth(), matmul_flops(), fp8_matmul_flops()
    torch.cuda.empty_cache()
    card = torch.cuda.get_device_name()
    print(f"{card}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {bf16_peak / 1e12:.0f} TFLOP/s, e4m3 _scaled_mm "
          f"{fp8_peak / 1e12:.0f} TFLOP/s, torch {torch.__version__}")
    print(f"{'proj':<8}{'M':>6}{'weights':>12}{'path':>8}{'us':>10}{'floor us':>10}{'TB/s':>7}{'of copy':>9}"
          f"{'TFLOP/s':>9}{'of peak':>9}")
    out = probe(rows, scales, args.repeats, bandwidth, bf16_peak, fp8_peak)
    for r in out:
        print(f"{r['projection']:<8}{r['rows']:>6}{r['weights']:>12}{r['path']:>8}{r['us']:>10.1f}"
              f"{r['floor_us']:>10.1f}{r['weight_tb_s']:>7.2f}{r['of_copy']:>9.0%}{r['tflop_s']:>9.1f}"
              f"{r['of_peak']:>9.0%}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"card": card, "copy_tb_s": bandwidth / 1e12, "bf16_matmul_tflop_s": bf16_peak / 1e12,
                       "fp8_matmul_tflop_s": fp8_peak / 1e12, "torch": torch.__version__, "rows": out}, fh, indent=1)


if __name__ == "__main__":
    main()
