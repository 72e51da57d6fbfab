"""A layer's weight GEMMs against the step's token count: is their cost a staircase along tokens, and which
`step_token_multiple` would the scheduler's cut pay back? (docs/benchmarks.md)

    python -m benchmarks.gemm_tiles [--tokens 256:1600:16] [--multiples 16,32,64,128,256]
        [--blas default,cublaslt] [--json r.json]

Times the four projections of a Llama-3-8B-shape layer (qkv, o, gate|up, down; bf16 on a GPU) as
`F.linear(x[M, K], W[N, K])`, the way the model calls them, for each token count M of the range: the median
of `--repeats` timed calls after a warm-up, with CUDA events on a GPU. For each candidate multiple m it
reports what cutting a step of M tokens to M' = ⌊M/m⌋·m (the rest goes into the next step) saves of the GEMMs'
cost per token, averaged over the range: 1 − (t(M')/M') / (t(M)/M). Positive: the cut pays. On a GPU,
`--blas` times the same calls once per library torch may route them to (torch.backends.cuda's
preferred_blas_library), each in turn over the whole range.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {   # name → [(projection, N, K)] of one layer
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "tiny": [("qkv", 96, 64), ("o", 64, 64), ("gate_up", 256, 64), ("down", 64, 128)],
}


def timer(device: torch.device):
    """fn, repeats → median seconds of one call."""
    if device.type == "cuda":
        def run(fn, repeats: int) -> float:
            times = []
            for _ in range(repeats):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            return statistics.median(times)
    else:
        def run(fn, repeats: int) -> float:
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times)
    return run


def layer_times(shape: str, tokens: list[int], device: torch.device, dtype: torch.dtype,
                repeats: int) -> dict[int, float]:
    """M → seconds of one layer's four projections at M tokens."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.02).to(device, dtype) for _, n, k in SHAPES[shape]]
    xs = {k: torch.randn(max(tokens), k, generator=gen).to(device, dtype) for _, _, k in SHAPES[shape]}
    time_it = timer(device)
    out: dict[int, float] = {}
    for m in tokens:
        inputs = [xs[w.shape[1]][:m] for w in weights]

        def layer() -> None:
            for x, w in zip(inputs, weights):
                F.linear(x, w)

        for _ in range(3):
            layer()
        out[m] = time_it(layer, repeats)
    return out


def cut_savings(times: dict[int, float], multiples: list[int]) -> dict[int, dict]:
    """For each multiple m: what cutting M tokens to ⌊M/m⌋·m saves of the cost per token, 1 − (t(cut)/cut) /
    (t(M)/M), its mean, least and most over the M of the range that are not multiples and whose cut was
    timed too. Multiples in the range count as saving 0: a cut leaves them as they are."""
    out = {}
    for mult in multiples:
        savings = []
        for m, t in times.items():
            cut = m // mult * mult
            if cut == m:
                savings.append(0.0)
            elif cut in times:
                savings.append(1 - (times[cut] / cut) / (t / m))
        if savings:
            out[mult] = {"mean": statistics.fmean(savings), "min": min(savings), "max": max(savings),
                         "points": len(savings)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemm_tiles")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--tokens", default="256:1600:16", help="start:stop:step of the token counts (stop excluded)")
    ap.add_argument("--multiples", default="16,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--blas", default="default,cublaslt",
                    help="on a GPU: the BLAS libraries to time, in turn (torch's preferred_blas_library names)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        lo, hi, step = (int(x) for x in a.tokens.split(":"))
        multiples = [int(x) for x in a.multiples.split(",")]
    except ValueError as exc:
        ap.error(f"--tokens is start:stop:step and --multiples a comma list of integers: {exc}")
    if not 0 < lo < hi or step <= 0:
        ap.error(f"--tokens: want start:stop:step with 0 < start < stop and step > 0, got {a.tokens!r}")
    if any(m <= 0 for m in multiples):
        ap.error(f"--multiples: each must be a positive number of tokens, got {a.multiples!r}")
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    tokens = list(range(lo, hi, step))
    blas = a.blas.split(",") if device.type == "cuda" else ["cpu"]
    times, savings = {}, {}
    for lib in blas:
        if device.type == "cuda":
            before = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library(lib)
        try:
            times[lib] = layer_times(a.shape, tokens, device, dtype, a.repeats)
        finally:
            if device.type == "cuda":
                torch.backends.cuda.preferred_blas_library(before)
        savings[lib] = cut_savings(times[lib], multiples)
    per_token_flops = 2 * sum(n * k for _, n, k in SHAPES[a.shape])
    print(f"{'tokens':>6}" + "".join(f" {lib + ' µs':>14} {'TFLOP/s':>8}" for lib in blas))
    for m in tokens:
        print(f"{m:>6}" + "".join(f" {times[lib][m] * 1e6:>14.1f} {per_token_flops * m / times[lib][m] / 1e12:>8.1f}"
                                   for lib in blas))
    print("cutting a step to a multiple: what it saves of the GEMMs' cost per token, mean (least … most)")
    for lib in blas:
        for mult, g in savings[lib].items():
            print(f"  {lib:>9} {mult:>4}: {100 * g['mean']:+.1f}% ({100 * g['min']:+.1f} … {100 * g['max']:+.1f}%)"
                  f" over {g['points']} token counts")
    if len(blas) > 1:
        base = blas[0]
        for lib in blas[1:]:
            ratio = statistics.fmean(times[base][m] / times[lib][m] for m in tokens)
            print(f"{lib} against {base}: {ratio:.3f}× the speed, mean over the range")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(device), "name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "dtype": str(dtype), "shape": a.shape, "layer_seconds": times, "cut_savings": savings}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
