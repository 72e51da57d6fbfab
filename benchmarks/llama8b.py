"""The engine on a Llama-3-8B-shape model with random bf16 weights, on one GPU, beside transformers `generate`
on the very same weights, in one run (the single-GPU figures of docs/benchmarks.md).

    python -m benchmarks.llama8b [--only parity,bs1,offline,mixed,profile] [--json results.json]
        [--mixed-budgets 1024,1536,2048] [--step-token-multiples 0,64,128] [--mma-warps 2,4]
        [--mixed-num-seqs 256,320] [--piecewise 1,0] [--decode-grids kv_heads,sequences] [--repeat 2]
        [--gpu-memory-utilization 0.6] [--quantization fp8]

parity   last-position prefill logits (4 prompts) and one decode step against transformers' forward; greedy
         agreement over 64 tokens for 32 prompts of 128 tokens
bs1      batch-1 decode after a 128-token prompt: ms per step with CUDA graphs, eager, and HF generate
offline  1,024 requests of 128 in / 128 out, all at once: output tokens/s (HF: 256 of them in one batch)
mixed    1,000 requests, inputs uniform in [64, 1024], outputs in [64, 512], all at once: tokens/s, TTFT, ITL
profile  where the GPU time of a step goes (GEMMs, attention, norms, sampling, …) for decode and mixed steps,
         and, with graphs, a step's host parts beside its graph's GPU time

--quantization fp8 quantizes the same bf16 weights at load (docs/quantization.md); transformers' baselines stay
bf16, and the batch-1 floor is then the bytes our model holds (FP8 projections, bf16 embedding row and LM head).

Floors: weight bytes / copy bandwidth per decode step; FLOPs / bf16 matmul rate; both measured on the card at
hand before the engine is built (ceilings.py; the H200 of ../shared/device/README.md: 4.25 TB/s, 782 TFLOP/s).
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
from .token_prompts import prompts

BANDWIDTH, FLOPS = 4.25e12, 782e12      # the H200's (../shared/device/README.md); main() sets the card's own
SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
             rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)


def build(seed: int = 0, kernels: str = "auto", gpu_memory_utilization: float = 0.6, **engine_kwargs):
    """transformers' model with random weights on the GPU, and our engine over the same tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mii_async.config import EngineConfig
    from mii_async.workers.engine import Engine

    torch.manual_seed(seed)
    cfg = LlamaConfig(**SHAPE, initializer_range=0.02)
    # Built in bf16 the way from_pretrained builds it: `.to(torch.bfloat16)` after the fact would also round
    # the rotary inv_freq buffer to bf16, and every position's angle with it.
    with torch.device("cuda"):
        hf = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    d = tempfile.mkdtemp(prefix="mii-8b-")
    cfg.save_pretrained(d)
    t0 = time.perf_counter()
    # 60% by default: on the H200 the KV pool still holds every benchmark's working set, and the parity check
    # has room for an fp32 copy of transformers' model as its reference. (On an 80 GB card the mixed load
    # fills that pool: --gpu-memory-utilization 0.9 for a mixed-only run.)
    engine = Engine(EngineConfig.from_kwargs(d, dtype="bfloat16", device="cuda",
                                            gpu_memory_utilization=gpu_memory_utilization,
                                            kernels=kernels, **engine_kwargs),
                    weights={k: v for k, v in hf.state_dict().items()})
    print(f"engine ready in {time.perf_counter() - t0:.1f} s; {engine.memory_plan.describe() if engine.memory_plan else ''}",
          flush=True)
    return hf, engine


def weight_bytes(hf) -> int:
    return sum(p.numel() * p.element_size() for p in hf.parameters())


def model_bytes(model) -> int:
    """Bytes a decode step reads from our model: every tensor it holds (each storage once, walking its
    attributes, lists and dicts), less the embedding table beyond the one row a token reads."""
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
    total = sum(seen.values())
    embed = SHAPE["vocab_size"] * SHAPE["hidden_size"] * 2
    return total - embed if not SHAPE["tie_word_embeddings"] else total


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float()))


def parity(hf, engine) -> dict:
    """Logits against transformers' forward on the same weights, and greedy agreement. The reference is
    transformers in fp32; transformers' own bf16 against it shows how far bf16 alone moves the numbers (random
    32-layer models amplify rounding: near-flat logits make greedy choices fragile)."""
    import copy

    hf32 = copy.deepcopy(hf).float()
    errs, derrs, hf_errs = [], [], []
    for i, p in enumerate(prompts(4, 128, 128, 1)):
        rid = 10_000 + i                    # the engine's own step, split to read the logits it samples from
        engine.add_request(rid, p, mii_async.SamplingParams(max_new_tokens=2, ignore_eos=True))
        seq = engine.seqs[rid]
        plan = engine.scheduler.schedule()
        lg = engine.runner.execute(plan).clone()
        engine.scheduler.commit(seq, len(plan.seqs[0].token_ids))
        nxt = int(lg[0].argmax())
        seq.output_ids.append(nxt)
        plan = engine.scheduler.schedule()          # a decode step: replayed from its CUDA graph
        lg2 = engine.runner.execute(plan).clone()
        engine.abort(rid)
        ids = torch.tensor([p + [nxt]], device="cuda")
        with torch.no_grad():
            ref = hf32(ids).logits[0, -2:]
            ref16 = hf(ids).logits[0, -2:]
        errs.append(rel(lg[0], ref[0]))
        derrs.append(rel(lg2[0], ref[1]))
        hf_errs.append(max(rel(ref16[0], ref[0]), rel(ref16[1], ref[1])))
    ps = prompts(32, 128, 128, 2)
    got: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    for i, p in enumerate(ps):
        engine.add_request(20_000 + i, p, mii_async.SamplingParams(max_new_tokens=64, ignore_eos=True))
    while engine.has_work():
        for o in engine.step():
            got[o.req_id - 20_000].append(o.token_id)
    ids = torch.tensor(ps, device="cuda")

    def greedy(m) -> list[list[int]]:
        with torch.no_grad():
            return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                              do_sample=False, pad_token_id=0)[:, 128:].tolist()

    ref32, ref16 = greedy(hf32), greedy(hf)
    del hf32
    torch.cuda.empty_cache()

    def agree(a: list[list[int]], b: list[list[int]]) -> dict:
        first = [next((j for j, (x, y) in enumerate(zip(u, v)) if x != y), 64) for u, v in zip(a, b)]
        return {"identical_64": f"{sum(f == 64 for f in first)}/{len(a)}", "tokens_before_divergence_mean":
                statistics.mean(first)}

    ours = [got[i] for i in range(len(ps))]
    return {"ours_bf16_vs_hf_fp32_prefill_logits_rel_err_max": max(errs),
            "ours_bf16_vs_hf_fp32_decode_logits_rel_err_max": max(derrs),
            "hf_bf16_vs_hf_fp32_logits_rel_err_max": max(hf_errs),
            "greedy_ours_bf16_vs_hf_fp32": agree(ours, ref32), "greedy_hf_bf16_vs_hf_fp32": agree(ref16, ref32),
            "greedy_ours_bf16_vs_hf_bf16": agree(ours, ref16)}


def bs1(hf, engine, new: int = 128) -> dict:
    """ms per decode step at batch 1 after a 128-token prompt: ours with graphs, ours eager, HF generate."""
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
    ids = torch.tensor([p], device="cuda")
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(4)
    out["hf_ms_per_step"] = 1e3 * (gen(new + 1) - gen(1)) / new
    out["floor_ms_per_step"] = 1e3 * weight_bytes(hf) / BANDWIDTH
    if engine.config.model.quantization:            # what our model reads: smaller than transformers' bf16
        out["floor_ms_per_step"] = 1e3 * model_bytes(engine.model) / BANDWIDTH
        out["floor_bytes"] = model_bytes(engine.model)
    return out


def offline(hf, engine, n: int = 1024, hf_n: int = 256) -> dict:
    """n requests of 128 in / 128 out at once: output tokens/s; HF: hf_n of them in one batch."""
    ps = prompts(n, 128, 128, 4)
    drain(engine, [(p, 4) for p in ps[:8]], 50_000)          # warm-up
    secs, times = drain(engine, [(p, 128) for p in ps], 51_000)
    toks = sum(len(t) for t in times.values())
    ids = torch.tensor(ps[:hf_n], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128,
                    do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    hf_s = time.perf_counter() - t0
    flops = 2 * weight_bytes(hf) / 2 * n * 256                       # 2 FLOPs per weight per token
    return {"ours_output_tok_s": toks / secs, "ours_seconds": secs, "requests": n,
            "hf_output_tok_s": hf_n * 128 / hf_s, "hf_batch": hf_n,
            "floor_seconds_flops": flops / FLOPS, "floor_output_tok_s": n * 128 / (flops / FLOPS)}


def ints(arg: str | None) -> list[int]:
    return [int(x) for x in arg.split(",")] if arg else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.llama8b")
    ap.add_argument("--only", default="parity,bs1,offline,mixed,profile")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quantization", default=None, help="fp8: the engine's projections in FP8, quantized at load")
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
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                    help="the engine's share of the GPU (default 0.6: room for transformers' baselines and the fp32 "
                         "parity reference on the H200)")
    a = ap.parse_args(argv)
    parts = a.only.split(",")
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
    hf, engine = build(kernels=a.kernels, gpu_memory_utilization=a.gpu_memory_utilization, **sched)
    # One width or grid order asked: the engine's for every part, its decode graphs captured again with it.
    recapture(engine, variant_config(engine.model.ops.config, warps[0] if len(warps) == 1 else None,
                                     grids[0] if len(grids) == 1 else None))
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                     **card, "gpu_memory_utilization": a.gpu_memory_utilization,
                     "weights_gb": weight_bytes(hf) / 1e9, "kernels": engine.kernels,
                     "quantization": a.quantization,
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
    steps = {"parity": lambda: parity(hf, engine), "bs1": lambda: bs1(hf, engine),
             "offline": lambda: offline(hf, engine),
             "mixed": lambda: (mixed_sweep(engine, ints(a.mixed_budgets) or [None],
                                           ints(a.step_token_multiples) or [sched_cfg.step_token_multiple or 0],
                                           a.repeat, not a.late_tokens, warps if len(warps) > 1 else [None],
                                           ints(a.mixed_num_seqs) or [None], ints(a.piecewise) or [None],
                                           grids or [None])
                               if (a.mixed_budgets or a.step_token_multiples or a.mixed_num_seqs or len(warps) > 1
                                   or a.piecewise or grids or a.repeat > 1)
                               else mixed(engine, early=not a.late_tokens)),
             "profile": lambda: {"bs1": profile(engine, 1), "bs256": profile(engine, 256),
                                 "mixed_128_decodes_1024_prompts": profile(engine, 128, prompt_len=1024),
                                 # the mixed load's steady state: ~255 decodes over ~700 tokens, a prompt a step
                                 "mixed_255_ctx704_one_prompt_448": profile(engine, 255, prompt_len=448, context=704,
                                                                            steady=True),
                                 **{f"graphs_bs{b}": graph_steps(engine, b) for b in (1, 64, 256, 512)
                                    if b <= engine.config.scheduler.max_num_seqs},
                                 # the mixed load's pure-decode steps: ~200-256 decodes over ~700 tokens
                                 **{f"graphs_bs{b}_ctx704": graph_steps(engine, b, prompt_len=704) for b in (192, 256)
                                    if b <= engine.config.scheduler.max_num_seqs}}}
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
