"""One mixture-of-experts layer on the GPU at real shapes (random bf16 weights): the residual add and norm,
routing and the experts as the model runs them (`ops.add_rms_norm_moe`: for a few tokens the router's GEMV and
moe_gemv.cu's two kernels; beyond, sort by expert, grouped GEMMs, un-permute, combine).

    python -m benchmarks.moe [--shapes mixtral-8x7b,qwen3-30b-a3b] [--tokens 1,8,64,2048] [--repeats 50]
        [--json out.json]

For each shape and step of T tokens: the median time of the layer replayed from a CUDA graph (as the decode
graphs run it) and called eagerly, and the torch reference's eager time beside them. Against the card's own
ceilings (ceilings.py, measured in the same run): the bytes the step must move (the router, the distinct
experts the tokens chose, 3·F·H weights each, and the input and output rows) over the copy bandwidth, which is
the floor at small T, where a step should read the chosen experts only; and the experts' FLOPs (2·T·k·3·F·H,
and the router's 2·T·E·H) per second against the bf16 matmul rate, which binds at large T.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from mii_async.kernels import get_ops, reference
from mii_async.kernels.config import KernelConfig

from .ceilings import copy_bandwidth, matmul_flops
from .gemm_tiles import timer
from .graph_replay import capture

SHAPES = {   # name → (experts E, experts per token k, hidden H, one expert's FFN F)
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}


def layer_weights(e: int, h: int, f: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """router [E, H], gate_up [E, 2F, H], down [E, H, F] in bf16 on the GPU, drawn one expert at a time (the
    fp32 draws of a whole Mixtral layer would take 11 GiB)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    router = (torch.randn(e, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    gate_up = torch.empty(e, 2 * f, h, device="cuda", dtype=torch.bfloat16)
    down = torch.empty(e, h, f, device="cuda", dtype=torch.bfloat16)
    for i in range(e):
        gate_up[i] = torch.randn(2 * f, h, device="cuda", generator=g) / h ** 0.5
        down[i] = torch.randn(h, f, device="cuda", generator=g) / f ** 0.5
    return router, gate_up, down


def probe(name: str, tokens: list[int], repeats: int, bandwidth: float, flops_peak: float) -> list[dict]:
    """One row per T of the shape `name`."""
    e, k, h, f = SHAPES[name]
    ops = get_ops("cuda", KernelConfig.from_env(os.environ))    # the engine's $MII_ASYNC_* choices
    router, gate_up, down = layer_weights(e, h, f)
    norm_w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    run = timer(torch.device("cuda"))
    rows = []
    for t in tokens:
        x, res = (torch.randn(t, h, device="cuda").bfloat16() for _ in range(2))

        def step() -> torch.Tensor:
            return ops.add_rms_norm_moe(x, res, norm_w, 1e-6, router, gate_up, down, k, True)[0]

        def ref_step() -> torch.Tensor:
            return reference.add_rms_norm_moe(x, res, norm_w, 1e-6, router, gate_up, down, k, True)[0]

        graph = capture(step)
        ref_step()
        torch.cuda.synchronize()
        graph_s, eager_s, ref_s = run(graph.replay, repeats), run(step, repeats), run(ref_step, max(3, repeats // 10))
        _, ids = reference.moe_route(reference.rms_norm(x + res, norm_w, 1e-6), router, k, True)
        distinct = int(ids.unique().numel())
        moved = (router.numel() + distinct * 3 * f * h + 4 * t * h) * 2          # bytes a step must move
        flops = 2 * t * k * 3 * f * h + 2 * t * e * h
        rows.append({"shape": name, "tokens": t, "distinct_experts": distinct, "graph_ms": graph_s * 1e3,
                     "eager_ms": eager_s * 1e3, "reference_ms": ref_s * 1e3, "bytes": moved,
                     "floor_ms": moved / bandwidth * 1e3, "of_bandwidth": moved / bandwidth / graph_s,
                     "tflop_s": flops / graph_s / 1e12, "of_matmul": flops / graph_s / flops_peak})
        del graph
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,8,64,2048", help="comma-separated token counts T of a step")
    ap.add_argument("--repeats", type=int, default=50, help="timed calls per figure (median)")
    ap.add_argument("--json", help="write the rows and the card's ceilings here")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    if any(t <= 0 for t in tokens):
        ap.error("--tokens: every token count must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.moe needs a CUDA GPU")
    bandwidth, peak = copy_bandwidth(), matmul_flops()
    card = torch.cuda.get_device_name()
    print(f"{card}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s, torch {torch.__version__}")
    print(f"{'shape':<15}{'T':>6}{'experts':>8}{'graph ms':>10}{'eager ms':>10}{'ref ms':>9}{'MB':>9}"
          f"{'floor ms':>10}{'of bw':>7}{'TFLOP/s':>9}{'of mm':>7}")
    rows = []
    for name in shapes:
        for r in probe(name, tokens, args.repeats, bandwidth, peak):   # its weights freed on return
            rows.append(r)
            print(f"{r['shape']:<15}{r['tokens']:>6}{r['distinct_experts']:>8}{r['graph_ms']:>10.3f}"
                  f"{r['eager_ms']:>10.3f}{r['reference_ms']:>9.2f}{r['bytes'] / 1e6:>9.1f}{r['floor_ms']:>10.3f}"
                  f"{r['of_bandwidth']:>7.0%}{r['tflop_s']:>9.1f}{r['of_matmul']:>7.0%}")
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"card": card, "copy_tb_s": bandwidth / 1e12, "matmul_tflop_s": peak / 1e12,
                       "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
