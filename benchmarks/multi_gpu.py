"""Tensor parallelism and replicas through the mesh: TP=T against TP=1 on the same weights, and R
replicas of TP=1 behind one router. Every figure comes from real deployments (`serve()`), one at a time.

    python -m benchmarks.multi_gpu [--shape 8b] [--tp 2] [--replicas 2] [--json results.json]

parity   greedy outputs (64 tokens, 32 prompts of 128) of TP=T against TP=1: identical requests, mean tokens
         before the first difference, and the largest gap between the chosen tokens' logprobs where they agree
bs1      batch-1 decode after a 128-token prompt: the median gap between streamed tokens, TP=1 and TP=T
offline  --requests requests of 128 in / 128 out, all at once: output tokens/s for TP=1, TP=T and R × TP=1

`--shape 8b` builds the Llama-3-8B-shape model (random bf16 weights, as in `llama8b`) and saves it as
safetensors in a temporary directory, which every deployment loads; `--shape tiny` is a 2-layer model that
runs on the CPU (gloo), to check the script itself. `--model DIR` serves a model directory instead.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from typing import Any

import mii_async

from mii_async.bench.word_tokenizer import save_word_tokenizer

from .served_load import bs1_ms_per_step, offline, prompts


def build_model(shape: str, out: str) -> str:
    """Random weights in the transformers layout, saved as safetensors, with a word-level tokenizer (the
    router needs one; the prompts are token ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .llama8b import SHAPE

    torch.manual_seed(0)
    if shape == "8b":
        cfg = LlamaConfig(**SHAPE, initializer_range=0.02)
        with torch.device("cuda"):
            model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    else:
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                          initializer_range=0.1, bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    del model
    save_word_tokenizer(out, cfg.vocab_size)
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_deployment(model: str, tp: int, replicas: int, a: argparse.Namespace, vocab: int,
                   parts: set[str]) -> dict[str, Any]:
    """One deployment: the parts asked for, then it is stopped."""
    opts: dict[str, Any] = {"kv_cache_memory": a.kv_cache_memory} if a.kv_cache_memory else {}
    t0 = time.perf_counter()
    client = mii_async.serve(model, tensor_parallel=tp, replicas=replicas, **opts)
    out: dict[str, Any] = {"tensor_parallel": tp, "replicas": replicas, "start_s": time.perf_counter() - t0}
    try:
        client(prompts(1, 16, vocab, 0), max_new_tokens=4, ignore_eos=True)       # warm-up
        if "parity" in parts:
            ps = prompts(a.parity_prompts, 128, vocab, 2)
            res = client(ps, max_new_tokens=a.parity_tokens, min_new_tokens=a.parity_tokens, logprobs=1)
            out["greedy"] = [r.token_ids for r in res]
            out["logprobs"] = [[lp.logprob for lp in (r.logprobs or [])] for r in res]
        if "bs1" in parts:
            out["bs1_ms_per_step"] = bs1_ms_per_step(client, vocab, a.bs1_tokens)
        if "offline" in parts:
            out.update(offline(client, vocab, a.requests))
        out["stats"] = client.run(client.stats())
    finally:
        client.terminate_server_sync(drain_s=0)
    return out


def compare(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Greedy agreement of `other` against `ref`, and the logprob gap on their common prefixes."""
    firsts = [_first_difference(x, y) for x, y in zip(ref["greedy"], other["greedy"])]
    gap = max((abs(u - v) for lx, ly, f in zip(ref["logprobs"], other["logprobs"], firsts)
               for u, v in zip(lx[:f], ly[:f])), default=0.0)
    n = len(ref["greedy"][0]) if ref["greedy"] else 0
    return {"identical": f"{sum(f == n for f in firsts)}/{len(firsts)}",
            "tokens_before_divergence_mean": statistics.mean(firsts) if firsts else 0.0,
            "max_chosen_logprob_gap": gap}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.multi_gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    ap.add_argument("--model", default=None, help="serve this model directory instead of building one")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--only", default="parity,bs1,offline")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--parity-prompts", type=int, default=32)
    ap.add_argument("--parity-tokens", type=int, default=64)
    ap.add_argument("--bs1-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="GiB per rank (the CPU's default)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    parts = set(a.only.split(","))
    tmp = None
    model = a.model
    if model is None:
        tmp = tempfile.mkdtemp(prefix="mii-multi-gpu-")
        t0 = time.perf_counter()
        model = build_model(a.shape, tmp)
        print(f"built and saved the {a.shape} model in {time.perf_counter() - t0:.0f} s", flush=True)
    with open(f"{model}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    try:
        runs = [run_deployment(model, 1, 1, a, vocab, parts)]
        print(f"TP=1: {json.dumps({k: v for k, v in runs[0].items() if k not in ('greedy', 'logprobs')})}", flush=True)
        if a.tp > 1:
            runs.append(run_deployment(model, a.tp, 1, a, vocab, parts))
            print(f"TP={a.tp}: {json.dumps({k: v for k, v in runs[-1].items() if k not in ('greedy', 'logprobs')})}",
                  flush=True)
        if a.replicas > 1 and "offline" in parts:
            runs.append(run_deployment(model, 1, a.replicas, a, vocab, {"offline"}))
            print(f"{a.replicas} replicas: {json.dumps(runs[-1])}", flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    one, result = runs[0], {"shape": a.shape if a.model is None else a.model, "date": time.strftime("%Y-%m-%d"),
                            "runs": [{k: v for k, v in r.items() if k not in ("greedy", "logprobs")} for r in runs]}
    tp = next((r for r in runs if r["tensor_parallel"] > 1), None)
    rep = next((r for r in runs if r["replicas"] > 1), None)
    if tp is not None and "parity" in parts:
        result["parity_tp_vs_tp1"] = compare(one, tp)
    if tp is not None and "bs1" in parts:
        result["bs1_tp_over_tp1"] = tp["bs1_ms_per_step"] / one["bs1_ms_per_step"]       # target ≤ 0.6
    if rep is not None:
        result["replicas_over_one"] = rep["offline_output_tok_s"] / one["offline_output_tok_s"]   # target ≥ 1.9
    if tp is not None and "offline" in parts:
        result["offline_tp_over_tp1"] = tp["offline_output_tok_s"] / one["offline_output_tok_s"]
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
