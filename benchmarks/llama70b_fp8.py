"""Llama-3-70B's shape in FP8 on one GPU, served: random weights written a layer at a time into a
compressed-tensors checkpoint (each layer made in bf16 on the card, quantized per output channel and written; the
model never exists in bf16, on the card or the host), then served by `mii_async.serve` with an FP8 KV cache.

    python -m benchmarks.llama70b_fp8 [--out DIR] [--spill /dev/shm/DIR] [--only bs1,offline] [--requests 256]
        [--gpu-memory-utilization 0.95] [--layers 80] [--keep] [--json results.json]

bs1      batch-1 decode after a 128-token prompt: the median gap between streamed tokens, beside the floor (the
         bytes a step reads: every FP8 projection and its scales, the bf16 LM head and one embedding row, over
         the copy bandwidth measured on this card first)
offline  --requests requests of 128 in / 128 out, all at once: output tokens/s
The worker logs its memory plan (weights, KV pool and its tokens, graphs) as it starts; the results hold the
deployment's stats.

The checkpoint is ~72.6 GB (68.4 GB of FP8 projections, a bf16 embedding and LM head of 2.1 GB each); shards that
would fill the disk go to --spill (default /dev/shm/…), linked from --out. The prompts are token ids over a word
tokenizer (mii_async/bench/word_tokenizer.py). --layers N builds a shallower model of the same width (to check the
script on a smaller card).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .served_load import bs1_ms_per_step, offline, prompts

LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                  rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)


def write_checkpoint(out: Path, spill: Path, layers: int, seed: int = 0) -> tuple[Path, dict[str, Any]]:
    """The 70B-shape checkpoint under `out`: FP8 projections (compressed-tensors, channel scales), bf16 rest."""
    from transformers import LlamaConfig

    from mii_async.bench.word_tokenizer import save_word_tokenizer
    from mii_async.workers.model.fp8_checkpoint import FP8CheckpointWriter

    shape = {**LLAMA3_70B, "num_hidden_layers": layers}
    config = {**LlamaConfig(**shape).to_dict(), "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    writer = FP8CheckpointWriter(out, config, "channel", spill=spill)
    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02)

    writer.append({"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h),
                   "model.norm.weight": torch.ones(h, dtype=torch.bfloat16, device="cuda")})
    for i in range(layers):
        p = f"model.layers.{i}."
        writer.append({p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                       p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                       p + "mlp.gate_proj.weight": rand(f, h), p + "mlp.up_proj.weight": rand(f, h),
                       p + "mlp.down_proj.weight": rand(h, f),
                       p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16, device="cuda"),
                       p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16, device="cuda")})
    writer.finish()
    save_word_tokenizer(out, v)
    return out, shape


def step_bytes(shape: dict[str, Any]) -> int:
    """What a batch-1 step reads: each FP8 projection (1 byte a weight, 4 a row's scale), the bf16 LM head and
    one bf16 embedding row."""
    h, f, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    rows_cols = [(h + 2 * kv, h), (h, h), (2 * f, h), (h, f)]
    per_layer = sum(n * k + 4 * n for n, k in rows_cols) + 2 * 2 * h           # + two bf16 norms
    return layers * per_layer + 2 * v * h + 2 * h + 2 * h


def serve_and_measure(model: Path, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    import mii_async

    t0 = time.perf_counter()
    client = mii_async.serve(str(model), tensor_parallel=1, kv_cache_dtype="fp8",
                             gpu_memory_utilization=a.gpu_memory_utilization, startup_timeout_s=900)
    out: dict[str, Any] = {"start_s": time.perf_counter() - t0}
    try:
        client(prompts(1, 16, vocab, 0), max_new_tokens=4, ignore_eos=True)       # warm-up
        if "bs1" in a.only:
            out["bs1_ms_per_step"] = bs1_ms_per_step(client, vocab, a.bs1_tokens)
        if "offline" in a.only:
            out.update(offline(client, vocab, a.requests))
        out["stats"] = client.run(client.stats())
    finally:
        client.terminate_server_sync(drain_s=0)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from . import ceilings

    ap = argparse.ArgumentParser(prog="python -m benchmarks.llama70b_fp8", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="the checkpoint's directory (default: a temporary one)")
    ap.add_argument("--spill", default=None, help="where shards go once the disk is nearly full (default: /dev/shm)")
    ap.add_argument("--only", default="bs1,offline")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--bs1-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.95)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (else removed at the end)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.only = set(a.only.split(","))
    card = ceilings.measure()
    print(f"this card: copy {card['copy_tb_s']:.2f} TB/s", flush=True)
    out = Path(a.out or tempfile.mkdtemp(prefix="mii-70b-fp8-"))
    spill = Path(a.spill or tempfile.mkdtemp(prefix="mii-70b-fp8-", dir="/dev/shm"))
    try:
        t0 = time.perf_counter()
        model, shape = write_checkpoint(out, spill, a.layers)
        size = json.loads((model / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        print(f"checkpoint: {size / 1e9:.1f} GB written in {time.perf_counter() - t0:.0f} s", flush=True)
        torch.cuda.empty_cache()
        floor_bytes = step_bytes(shape)
        results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                                   "layers": a.layers, "checkpoint_gb": size / 1e9, **card,
                                   "floor_bytes": floor_bytes,
                                   "floor_ms_per_step": 1e3 * floor_bytes / (card["copy_tb_s"] * 1e12)}
        results.update(serve_and_measure(model, a, shape["vocab_size"]))
        if "bs1_ms_per_step" in results:
            results["bs1_of_floor"] = results["floor_ms_per_step"] / results["bs1_ms_per_step"]
        print(json.dumps({k: v for k, v in results.items() if k != "stats"}, indent=1), flush=True)
        print("stats:", json.dumps(results.get("stats"), default=str)[:4000], flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1, default=str))
        return results
    finally:
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(spill, ignore_errors=True)


if __name__ == "__main__":
    main()
