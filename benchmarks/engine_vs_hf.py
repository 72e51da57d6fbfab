"""Our engine against Hugging Face `generate`, on one workload, in one run, on one machine.

Three systems get the same N prompts of seeded random token ids (no two alike, so the prefix cache cannot turn
one request's work into another's) and each generates exactly `--new-tokens` greedy tokens:
ours with all N requests streamed at once; HF one request at a time; HF with all N left-padded into one batch.
Rates are output tokens per second of wall time, model load and one warm-up each excluded.

    python -m benchmarks.engine_vs_hf [--requests 32] [--new-tokens 64] [--mesh] [--json results.json]

`--mesh` also streams the same prompts through `serve()` (router and worker processes over ZeroMQ), to show
what the mesh costs over the in-process engine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from typing import Any, NamedTuple

import torch

import mii_async


class Result(NamedTuple):
    system: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def make_prompts(n: int, lo: int, hi: int, seed: int, vocab: int, special: set[int]) -> list[list[int]]:
    rng = random.Random(seed)
    pool = [t for t in range(vocab) if t not in special]   # special ids would make the prompts unlike text
    return [[rng.choice(pool) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def _stream_all(pipe: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[Any]]:
    """Streams every prompt concurrently; returns the wall time and, per request, (ids, chunk times, usage)."""
    async def one(p: list[int]) -> tuple[list[int], list[float], Any]:
        ids: list[int] = []
        times: list[float] = []
        usage = None
        async for chunk in pipe.stream(p, max_new_tokens=new_tokens, min_new_tokens=new_tokens, ignore_eos=True):
            if chunk.token_ids:
                times.append(time.perf_counter())
                ids.extend(chunk.token_ids)
            usage = chunk.usage or usage
        return ids, times, usage

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, [(ids, [t - t0 for t in times], u) for ids, times, u in outs]


def run_ours(pipe: Any, prompts: list[list[int]], new_tokens: int) -> tuple[Result, dict[str, float], list[list[int]]]:
    seconds, outs = asyncio.run(_stream_all(pipe, prompts, new_tokens))
    for i, (ids, _, usage) in enumerate(outs):
        # The benchmark must not silently measure less work than it claims.
        assert len(ids) == new_tokens and usage.completion_tokens == new_tokens, \
            f"request {i}: {len(ids)} tokens streamed, usage {usage}, expected {new_tokens}"
    total = sum(len(ids) for ids, _, _ in outs)
    assert total == len(prompts) * new_tokens, f"{total} output tokens, expected {len(prompts) * new_tokens}"
    ttft = sorted(times[0] for _, times, _ in outs)
    itl = sorted(b - a for _, times, _ in outs for a, b in zip(times, times[1:]))
    latency = {"ttft_p50_s": _pct(ttft, 0.5), "ttft_max_s": ttft[-1],
               "itl_p50_s": _pct(itl, 0.5), "itl_p90_s": _pct(itl, 0.9)}
    return Result("mii_async engine, all at once", len(prompts), total, seconds), latency, [o[0] for o in outs]


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf_sequential(model: Any, prompts: list[list[int]], gen: dict[str, Any]) -> tuple[Result, list[list[int]]]:
    n, device, outs = gen["max_new_tokens"], model.device, []
    _sync(device)
    t0 = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)   # [1, len(p) + n]
        outs.append(out[0, len(p):].tolist())
    seconds = time.perf_counter() - t0
    assert all(len(o) == n for o in outs), "HF generated a different number of tokens than asked"
    return Result("HF generate, one at a time", len(prompts), n * len(prompts), seconds), outs


def run_hf_batched(model: Any, prompts: list[list[int]], gen: dict[str, Any]) -> Result:
    n, device, width = gen["max_new_tokens"], model.device, max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), gen["pad_token_id"], dtype=torch.long)   # [N, width], left-padded
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **gen)                           # [N, width + n]
    _sync(device)
    seconds = time.perf_counter() - t0
    assert out.shape[1] - width == n, f"HF batched generated {out.shape[1] - width} tokens, expected {n}"
    return Result("HF generate, batched (left-padded)", len(prompts), n * len(prompts), seconds)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-sequential-requests", type=int, default=None,
                    help="requests the one-at-a-time baseline runs (default: all); its rate is over these")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--mesh", action="store_true",
                    help="also run the same workload through serve(): a router process and one worker process")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, __version__ as hf_version

    device = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    # The engine's own rule for "auto" (workers/engine.py), so both sides run the same precision.
    dtype_name = a.dtype if a.dtype != "auto" else ("float32" if device.type == "cpu" else "bfloat16")
    opts = {k: v for k, v in (("max_batch_tokens", a.max_batch_tokens), ("max_num_seqs", a.max_num_seqs)) if v}
    pipe = mii_async.pipeline(a.model, device=str(device), dtype=dtype_name, **opts)
    try:
        tok = pipe.tokenizer
        prompts = make_prompts(a.requests, *a.prompt_len, a.seed, len(tok), set(tok.all_special_ids))
        warm = make_prompts(1, 8, 8, a.seed + 1, len(tok), set(tok.all_special_ids))
        pipe(warm, max_new_tokens=4, ignore_eos=True)
        steps_before = pipe.stats()["steps"]
        ours, latency, our_ids = run_ours(pipe, prompts, a.new_tokens)
        stats = pipe.stats()
        stats["workload_steps"] = stats["steps"] - steps_before   # the warm-up's steps left out
        model_path = pipe.model_path
    finally:
        pipe.close()   # frees the engine's threads and KV pool before HF runs on the same cores

    mesh = mesh_latency = None
    if a.mesh:
        client = mii_async.serve(a.model, device=str(device), dtype=dtype_name, **opts)
        try:
            client(warm, max_new_tokens=4, ignore_eos=True)
            mesh, mesh_latency, mesh_ids = run_ours(client, prompts, a.new_tokens)
            mesh = mesh._replace(system="mii_async via router + worker process")
            assert mesh_ids == our_ids, "the mesh changed greedy outputs"
        finally:
            client.terminate_server_sync(drain_s=0)

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype_name)).to(device).eval()
    eos = tok.eos_token_id
    gen = dict(do_sample=False, min_new_tokens=a.new_tokens, max_new_tokens=a.new_tokens, pad_token_id=eos,
               temperature=None, top_p=None, top_k=None)   # the model's sampling defaults would only warn
    model.generate(torch.tensor(warm, device=device), **{**gen, "min_new_tokens": 4, "max_new_tokens": 4})
    seq, hf_ids = run_hf_sequential(model, prompts[:a.hf_sequential_requests or a.requests], gen)
    batched = run_hf_batched(model, prompts, gen)

    rows = [ours] + ([mesh] if mesh else []) + [seq, batched]
    print("| system | requests | output tokens | seconds | tok/s | ours ÷ this |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.system} | {r.requests} | {r.output_tokens} | {r.seconds:.2f} | {r.tok_s:.1f} | "
              f"{ours.tok_s / r.tok_s:.2f}× |")
    print(f"\nours: TTFT p50 {latency['ttft_p50_s'] * 1e3:.0f} ms, max {latency['ttft_max_s'] * 1e3:.0f} ms; "
          f"ITL p50 {latency['itl_p50_s'] * 1e3:.1f} ms, p90 {latency['itl_p90_s'] * 1e3:.1f} ms; "
          f"{stats['workload_steps']} engine steps, {stats['preemptions']} preemptions")
    if mesh_latency:
        print(f"mesh: TTFT p50 {mesh_latency['ttft_p50_s'] * 1e3:.0f} ms, max {mesh_latency['ttft_max_s'] * 1e3:.0f} ms; "
              f"ITL p50 {mesh_latency['itl_p50_s'] * 1e3:.1f} ms, p90 {mesh_latency['itl_p90_s'] * 1e3:.1f} ms; "
              "greedy outputs identical to the in-process engine")
    same = sum(o == h for o, h in zip(our_ids, hf_ids))   # greedy, same precision: mostly equal, not asserted
    print(f"greedy outputs identical to HF one-at-a-time: {same}/{len(hf_ids)}")
    machine = {"cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": hf_version,
               "torch_threads": torch.get_num_threads(), "device": str(device), "dtype": dtype_name}
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    results = {"config": vars(a), "machine": machine, "engine_stats": stats, "latency": latency,
               "mesh_latency": mesh_latency,
               "identical_outputs": [same, len(hf_ids)],
               "results": [{**r._asdict(), "tok_s": r.tok_s} for r in rows],
               "ratio_vs_hf_sequential": ours.tok_s / seq.tok_s, "ratio_vs_hf_batched": ours.tok_s / batched.tok_s}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
