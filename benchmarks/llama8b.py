"""The engine on a real-size model with random bf16 weights (Llama-3-8B's shape unless --shape names another:
benchmarks/model_shapes.py), on one GPU, beside transformers `generate` on the very same weights, in one run (the
single-GPU figures of docs/benchmarks.md and docs/models.md).

    python -m benchmarks.llama8b [--shape llama3-8b|llama3.1-8b|qwen3-8b|gemma2-9b|gemma3-12b|phi4-mini|
        qwen3-30b-a3b] [--only parity,bs1,offline,mixed,profile,long,long1,longparity] [--json results.json] [--hf-batches 64,256]
        [--mixed-budgets 1024,1536,2048] [--step-token-multiples 0,64,128] [--mma-warps 2,4]
        [--mixed-num-seqs 256,320] [--piecewise 1,0] [--decode-grids kv_heads,sequences] [--repeat 2]
        [--gpu-memory-utilization 0.6] [--quantization fp8] [--kv-cache-dtype fp8] [--profile-parts bs1]

parity   last-position prefill logits (4 prompts) and one decode step against transformers' forward in fp32
         (bf16 for a mixture of experts, whose fp32 copy would not fit), beside transformers' own bf16 against it;
         greedy agreement over 64 tokens for 32 prompts of 128 tokens (benchmarks/hf_baseline.py)
bs1      batch-1 decode after a 128-token prompt: ms per step with CUDA graphs, eager, and HF generate
offline  1,024 requests of 128 in / 128 out, all at once: output tokens/s (HF: the first --hf-batches of them in
         one batch, each size once; its best is the baseline)
mixed    1,000 requests, inputs uniform in [64, 1024], outputs in [64, 512], all at once: tokens/s, TTFT, ITL
long     64 requests of 4,000–7,900 prompt tokens / 256 out, all at once: total tokens/s against the FLOP floor,
         TTFT and ITL (benchmarks/long_prompts.py; --shape llama3.1-8b serves 32k contexts)
long1    one 32,000-token prompt: TTFT against its FLOP floor, decode at that context against decode at 128
longparity  greedy tokens and last-position logits against transformers at 8k and 32k prompt tokens
profile  where the GPU time of a step goes (GEMMs, attention, norms, sampling, …) for decode and mixed steps,
         and, with graphs, a step's host parts beside its graph's GPU time (--profile-parts picks some)

transformers' side runs first; for a mixture of experts (or with --release-hf) its weights then move to the host
and our engine loads them from there (both copies of a 30B model would not fit an 80 GB card).

--quantization fp8 quantizes the same bf16 weights at load (docs/quantization.md); transformers' baselines stay
bf16, the parity check adds transformers in fp32 over the FP8-rounded projections, and the batch-1 floor is
then the bytes our model holds (FP8 projections, bf16 embedding row and LM head). --kv-cache-dtype fp8 keeps K/V in
e4m3 (the pool holds twice the tokens); the parity part then measures the cache's rounding as well.

Floors (benchmarks/model_shapes.py): the bytes a batch-1 step reads (each weight a token multiplies, once) /
copy bandwidth; FLOPs (two per such weight a token) / bf16 matmul rate; both rates measured on the card at hand
before the engine is built (ceilings.py; the H200 of ../shared/device/README.md: 4.25 TB/s, 782 TFLOP/s).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import mii_async
from mii_async.kernels.config import GRID_ORDERS

from . import ceilings
from .engine_drain import drain
from .kernel_variants import recapture, variant_config
from .mixed_load import mixed, mixed_sweep
from .step_profile import graph_steps, profile
from .hf_baseline import hf_bs1, hf_offline, parity_references
from .long_prompts import kv_token_bytes, long_load, long_one, long_parity
from .model_shapes import LLAMA3_8B, SHAPES, build_hf, checkpoint_tensors, step_bytes, token_flops
from .token_prompts import prompts

BANDWIDTH, FLOPS = 4.25e12, 782e12      # the H200's (../shared/device/README.md); main() sets the card's own
SHAPE = LLAMA3_8B


def build_engine(config, weights: dict[str, torch.Tensor], kernels: str = "auto",
                 gpu_memory_utilization: float = 0.6, **engine_kwargs):
    """Our engine over `weights` (a checkpoint's names → tensors; those already on the GPU in bf16 are used as
    they are) and transformers' config of them."""
    from mii_async.config import EngineConfig
    from mii_async.workers.engine import Engine

    d = tempfile.mkdtemp(prefix="mii-shape-")
    config.save_pretrained(d)
    t0 = time.perf_counter()
    # 60% by default: on the H200 the KV pool still holds every benchmark's working set. (On an 80 GB card the
    # mixed load fills that pool: --gpu-memory-utilization 0.9 for a mixed-only run.)
    engine = Engine(EngineConfig.from_kwargs(d, dtype="bfloat16", device="cuda",
                                            gpu_memory_utilization=gpu_memory_utilization,
                                            kernels=kernels, **engine_kwargs), weights=weights)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s; {engine.memory_plan.describe() if engine.memory_plan else ''}",
          flush=True)
    return engine


def build(shape: str = "llama3-8b", seed: int = 0, kernels: str = "auto", gpu_memory_utilization: float = 0.6,
          **engine_kwargs):
    """transformers' model of `shape` with random weights on the GPU, and our engine over the same tensors."""
    cfg, hf = build_hf(shape, seed)
    return hf, build_engine(cfg, checkpoint_tensors(hf), kernels, gpu_memory_utilization,
                            **{**SHAPES[shape].engine, **engine_kwargs})


def model_bytes(model, embed_bytes: int) -> int:
    """Bytes a decode step reads from our model: every tensor it holds (each storage once, walking its
    attributes, lists and dicts), less the embedding table (`embed_bytes`; 0 where it is tied to the LM head)
    beyond the one row a token reads."""
    seen: dict[int, int] = {}
    stack, visited = [model], set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda:
                seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.startswith("mii_async"):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, n) for n in obj.__slots__ if hasattr(obj, n))
    return sum(seen.values()) - embed_bytes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float()))


def parity(engine, refs: dict) -> dict:
    """Our logits and greedy tokens against the references hf_baseline.parity_references made: the last
    position of each parity prompt (prefill), and the position after it once the reference's greedy token is
    appended (a decode step, replayed from its CUDA graph); greedy agreement over 64 tokens for 32 prompts."""
    main_ref = refs.get("fp32", refs["bf16"])
    errs: dict[str, list[float]] = {}
    for i, p in enumerate(refs["prompts"]):
        rid = 10_000 + i                    # the engine's own step, split to read the logits it samples from
        engine.add_request(rid, p, mii_async.SamplingParams(max_new_tokens=2, ignore_eos=True))
        seq = engine.seqs[rid]
        plan = engine.scheduler.schedule()
        lg = engine.runner.execute(plan)[0].float().cpu()
        engine.scheduler.commit(seq, len(plan.seqs[0].token_ids))
        seq.output_ids.append(main_ref["next"][i])
        plan = engine.scheduler.schedule()
        lg2 = engine.runner.execute(plan)[0].float().cpu()
        engine.abort(rid)
        for name, ref in refs.items():
            if isinstance(ref, dict):
                errs.setdefault(f"ours_vs_hf_{name}_prefill_logits_rel_err_max", []).append(rel(lg, ref["last"][i]))
                errs.setdefault(f"ours_vs_hf_{name}_decode_logits_rel_err_max", []).append(rel(lg2, ref["after"][i]))
        if "fp32" in refs:
            errs.setdefault("hf_bf16_vs_hf_fp32_logits_rel_err_max", []).append(
                max(rel(refs["bf16"]["last"][i], refs["fp32"]["last"][i]),
                    rel(refs["bf16"]["after"][i], refs["fp32"]["after"][i])))
    out: dict = {k: max(v) for k, v in errs.items()}
    ps = refs["greedy_prompts"]
    got: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    for i, p in enumerate(ps):
        engine.add_request(20_000 + i, p, mii_async.SamplingParams(max_new_tokens=64, ignore_eos=True))
    while engine.has_work():
        for o in engine.step():
            got[o.req_id - 20_000].append(o.token_id)
    ours = [got[i] for i in range(len(ps))]

    def agree(a: list[list[int]], b: list[list[int]]) -> dict:
        first = [next((j for j, (x, y) in enumerate(zip(u, v)) if x != y), 64) for u, v in zip(a, b)]
        return {"identical_64": f"{sum(f == 64 for f in first)}/{len(a)}", "tokens_before_divergence_mean":
                statistics.mean(first)}

    for name, ref in refs.items():
        if isinstance(ref, dict):
            out[f"greedy_ours_vs_hf_{name}"] = agree(ours, ref["greedy"])
    if "fp32" in refs:
        out["greedy_hf_bf16_vs_hf_fp32"] = agree(refs["bf16"]["greedy"], refs["fp32"]["greedy"])
    return out


def bs1(engine, new: int = 128) -> dict:
    """ms per decode step at batch 1 after a 128-token prompt: ours with graphs, and eager."""
    out = {}
    p = prompts(1, 128, 128, 3)[0]
    graphs, pieces = engine.runner.graphs, engine.runner.piecewise
    for name, g in (("graphs", graphs), ("eager", None)):
        if name == "graphs" and graphs is None:
            continue
        engine.runner.graphs = g
        engine.runner.piecewise = pieces if g is not None else None
        drain(engine, [(p, 8)], 40_000)                     # warm-up
        _, times = drain(engine, [(p, new + 1)], 41_000)
        t = times[41_000]
        out[f"ours_{name}_ms_per_step"] = 1e3 * statistics.median(b - a for a, b in zip(t[1:], t[2:]))
    engine.runner.graphs, engine.runner.piecewise = graphs, pieces
    return out


def offline(engine, n: int = 1024) -> dict:
    """n requests of 128 in / 128 out at once: output tokens/s."""
    ps = prompts(n, 128, 128, 4)
    drain(engine, [(p, 4) for p in ps[:8]], 50_000)          # warm-up
    secs, times = drain(engine, [(p, 128) for p in ps], 51_000)
    toks = sum(len(t) for t in times.values())
    return {"ours_output_tok_s": toks / secs, "ours_seconds": secs, "requests": n}


PROFILE_PARTS = ("bs1", "bs256", "mixed", "steady", "graphs", "long", "longmixed")


def profiles(engine, parts: list[str]) -> dict:
    """The `profile` part's profiles named in `parts` (PROFILE_PARTS): eager steps by kernel category at batch 1
    and 256, mixed steps (128 decodes and 1,024-token prompts; the mixed load's steady state, ~255 decodes over
    ~700 tokens and a prompt a step), graph replays' host and GPU time, and long prompts: chunks of 7,900-token
    prompts alone (contexts 0 to 7.9k) and beside 64 decodes at 4,000 tokens of context."""
    out: dict = {}
    max_seqs = engine.config.scheduler.max_num_seqs
    if "bs1" in parts:
        out["bs1"] = profile(engine, 1)
    if "bs256" in parts and max_seqs >= 256:
        out["bs256"] = profile(engine, 256)
    if "mixed" in parts:
        out["mixed_128_decodes_1024_prompts"] = profile(engine, 128, prompt_len=1024)
    if "steady" in parts:
        out["mixed_255_ctx704_one_prompt_448"] = profile(engine, 255, prompt_len=448, context=704, steady=True)
    if "long" in parts:
        out["long_prompts_7900"] = profile(engine, 0, prompt_len=7900)
    if "longmixed" in parts and max_seqs >= 64:
        out["long_64_ctx4000_prompts_7900"] = profile(engine, 64, prompt_len=7900, context=4000)
    if "graphs" in parts:
        out.update({f"graphs_bs{b}": graph_steps(engine, b) for b in (1, 64, 256, 512) if b <= max_seqs})
        # the mixed load's pure-decode steps: ~200-256 decodes over ~700 tokens
        out.update({f"graphs_bs{b}_ctx704": graph_steps(engine, b, prompt_len=704) for b in (192, 256)
                    if b <= max_seqs})
    return out


def ints(arg: str | None) -> list[int]:
    return [int(x) for x in arg.split(",")] if arg else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.llama8b")
    ap.add_argument("--only", default="parity,bs1,offline,mixed,profile")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES),
                    help="the model's shape (benchmarks/model_shapes.py), random bf16 weights")
    ap.add_argument("--hf-batches", default="256",
                    help="offline: transformers generate's batch sizes, each run once (its best is the baseline)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quantization", default=None, help="fp8: the engine's projections in FP8, quantized at load")
    ap.add_argument("--kv-cache-dtype", default=None, help="fp8: K/V cached in e4m3")
    ap.add_argument("--profile-parts", default=",".join(PROFILE_PARTS),
                    help=f"profile: which of {', '.join(PROFILE_PARTS)} (bs1 alone is the cheap one)")
    ap.add_argument("--kernels", default="auto", help="auto (the CuPy kernels) or reference (torch ops)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="the scheduler's (default: the GPU default)")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="the token budget (default: the GPU default)")
    ap.add_argument("--max-mixed-batch-tokens", type=int, default=None,
                    help="the budget of a step with decodes (default: the GPU default)")
    ap.add_argument("--mixed-budgets", default=None,
                    help="mixed: run the load once per max_mixed_batch_tokens in this comma list, in one process")
    ap.add_argument("--step-token-multiples", default=None,
                    help="mixed: run the load once per step_token_multiple in this comma list (0 or 1: not cut), in "
                         "one process (with --mixed-budgets, once per pair)")
    ap.add_argument("--mixed-num-seqs", default=None,
                    help="mixed: run the load once per max_num_seqs in this comma list, in one process (the engine "
                         "is built for the largest: its decode graphs cover every batch)")
    ap.add_argument("--step-token-multiple", type=int, default=None,
                    help="the scheduler's step_token_multiple (default: 64 on a GPU; 1: steps are not cut)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="mixed: rounds over the variants listed (budgets, multiples, num seqs, widths), or runs of the "
                         "defaults, after one warm-up")
    ap.add_argument("--mma-warps", default=None,
                    help="decode attention's tensor-core kernel at this block width (2 or 4) for every batch "
                         "(default: KernelConfig.mma_narrow_from's choice by batch); mixed: a comma list runs the "
                         "load once per width, in one process, each with graphs of its own")
    ap.add_argument("--decode-grids", default=None,
                    help="mixed: a comma list of decode attention's grid orders (kv_heads, sequences) runs the load "
                         "once per order, in one process, each with decode graphs of its own")
    ap.add_argument("--piecewise", default=None,
                    help="mixed: a comma list of 1 / 0 runs the load with and without the piecewise graphs of steps "
                         "with prompt chunks, in one process")
    ap.add_argument("--late-tokens", action="store_true",
                    help="mixed: tokens handed over at the end of each step (engine.step() without emit)")
    ap.add_argument("--release-hf", action="store_true",
                    help="let transformers' model go before our engine loads, its weights handed over through the "
                         "host (always so for a mixture of experts), so that the engine may take more of the card "
                         "(a model whose KV cache per token is large needs a larger pool for the offline load)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                    help="the engine's share of the GPU (default 0.6: room for transformers' baselines and the fp32 "
                         "parity reference on the H200)")
    a = ap.parse_args(argv)
    parts = a.only.split(",")
    if any(p not in PROFILE_PARTS for p in a.profile_parts.split(",")):
        ap.error(f"--profile-parts: parts are {', '.join(PROFILE_PARTS)}, got {a.profile_parts}")
    sched = {k: v for k, v in (("max_num_seqs", a.max_num_seqs), ("max_batch_tokens", a.max_batch_tokens),
                               ("max_mixed_batch_tokens", a.max_mixed_batch_tokens),
                               ("step_token_multiple", a.step_token_multiple)) if v}
    warps = ints(a.mma_warps)
    if any(w not in (2, 4) for w in warps):
        ap.error(f"--mma-warps: widths are 2 or 4, got {a.mma_warps}")
    grids = a.decode_grids.split(",") if a.decode_grids else []
    if any(g not in GRID_ORDERS for g in grids):
        ap.error(f"--decode-grids: orders are {', '.join(GRID_ORDERS)}, got {a.decode_grids}")
    if a.mixed_num_seqs:
        sched["max_num_seqs"] = max(ints(a.mixed_num_seqs))
    global BANDWIDTH, FLOPS
    card = ceilings.measure()
    BANDWIDTH, FLOPS = card["copy_tb_s"] * 1e12, card["matmul_tflop_s"] * 1e12
    print(f"this card: copy {card['copy_tb_s']:.2f} TB/s, bf16 matmul {card['matmul_tflop_s']:.0f} TFLOP/s", flush=True)
    if a.quantization:
        sched["quantization"] = a.quantization
    if a.kv_cache_dtype:
        sched["kv_cache_dtype"] = a.kv_cache_dtype
    shape = SHAPES[a.shape]
    release = shape.moe or a.release_hf
    if release and "longparity" in parts:
        ap.error("--only longparity: transformers' model is let go before our engine loads (--release-hf, or a "
                 "mixture of experts)")
    cfg, hf = build_hf(a.shape)
    weights_gb = sum(p.numel() * p.element_size() for p in hf.parameters()) / 1e9
    floor_bytes, flops_per_token = step_bytes(hf), token_flops(hf)
    embed_bytes = 0 if cfg.tie_word_embeddings else 2 * cfg.vocab_size * cfg.hidden_size
    # transformers first: a mixture of experts whose two copies would not fit hands its weights over after.
    t0 = time.perf_counter()
    refs = (parity_references(hf, fp32=not shape.moe, fp8_weights=a.quantization == "fp8")
            if "parity" in parts else None)
    hf_ms = hf_bs1(hf) if "bs1" in parts else None
    hf_tok_s = hf_offline(hf, ints(a.hf_batches)) if "offline" in parts else {}
    print(f"transformers' side ({time.perf_counter() - t0:.0f} s): bs1 {hf_ms} ms/step, offline {hf_tok_s}", flush=True)
    weights = checkpoint_tensors(hf)
    if release:
        weights = {k: v.cpu() for k, v in weights.items()}
        del hf
        torch.cuda.empty_cache()
    engine = build_engine(cfg, weights, a.kernels, a.gpu_memory_utilization, **{**shape.engine, **sched})
    del weights
    # One width or grid order asked: the engine's for every part, its decode graphs captured again with it.
    recapture(engine, variant_config(engine.model.ops.config, warps[0] if len(warps) == 1 else None,
                                     grids[0] if len(grids) == 1 else None))
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                     "shape": a.shape, **card, "gpu_memory_utilization": a.gpu_memory_utilization,
                     "weights_gb": weights_gb, "kernels": engine.kernels,
                     "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype or "auto",
                     "graphs": bool(engine.runner.graphs), "num_blocks": engine.num_blocks,
                     "max_batch_tokens": engine.config.scheduler.max_batch_tokens,
                     "max_num_seqs": engine.config.scheduler.max_num_seqs,
                     "max_mixed_batch_tokens": engine.config.scheduler.max_mixed_batch_tokens,
                     "step_token_multiple": engine.config.scheduler.step_token_multiple}
    if engine.runner.graphs is not None:
        results["graph_capture_s"] = engine.runner.graphs.capture_seconds
        results["graph_memory_gib"] = engine.runner.graphs.memory / 2**30
    if engine.runner.piecewise is not None:
        results["piecewise_capture_s"] = engine.runner.piecewise.capture_seconds
        results["piecewise_memory_gib"] = engine.runner.piecewise.memory / 2**30
    sched_cfg = engine.config.scheduler
    if a.quantization:                  # what our model reads: FP8 projections, the LM head in bf16
        floor_bytes = model_bytes(engine.model, embed_bytes)

    def with_floor_bs1() -> dict:
        return {**bs1(engine), "hf_ms_per_step": hf_ms, "floor_ms_per_step": 1e3 * floor_bytes / BANDWIDTH,
                "floor_bytes": floor_bytes}

    def with_floor_offline(n: int = 1024) -> dict:
        flops = flops_per_token * n * 256                   # 128 prompt and 128 output tokens each
        best = max(hf_tok_s, key=hf_tok_s.get)
        return {**offline(engine, n), "hf_output_tok_s": hf_tok_s[best], "hf_batch": best,
                "hf_output_tok_s_by_batch": hf_tok_s, "floor_seconds_flops": flops / FLOPS,
                "floor_output_tok_s": n * 128 / (flops / FLOPS)}

    steps = {"parity": lambda: parity(engine, refs), "bs1": with_floor_bs1, "offline": with_floor_offline,
             "long": lambda: long_load(engine, cfg, flops_per_token, FLOPS, BANDWIDTH,
                                       kv_token_bytes(cfg, 1 if a.kv_cache_dtype == "fp8" else 2)),
             "long1": lambda: long_one(engine, cfg, flops_per_token, FLOPS),
             "longparity": lambda: long_parity(engine, hf),
             "mixed": lambda: (mixed_sweep(engine, ints(a.mixed_budgets) or [None],
                                           ints(a.step_token_multiples) or [sched_cfg.step_token_multiple or 0],
                                           a.repeat, not a.late_tokens, warps if len(warps) > 1 else [None],
                                           ints(a.mixed_num_seqs) or [None], ints(a.piecewise) or [None],
                                           grids or [None])
                               if (a.mixed_budgets or a.step_token_multiples or a.mixed_num_seqs or len(warps) > 1
                                   or a.piecewise or grids or a.repeat > 1)
                               else mixed(engine, early=not a.late_tokens)),
             "profile": lambda: profiles(engine, a.profile_parts.split(","))}
    for name in parts:
        t0 = time.perf_counter()
        results[name] = steps[name]()
        print(f"{name} ({time.perf_counter() - t0:.0f} s): {json.dumps(results[name], indent=1)}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
