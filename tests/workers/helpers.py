"""Helpers for engine tests: drive an Engine on token ids, and transformers' greedy reference."""
from __future__ import annotations

import json
from pathlib import Path

from mii_async.config import EngineConfig
from mii_async.params import SamplingParams


def head_dim_model(tmp_path: Path, hidden: int, heads: int, kv: int, max_pos: int, layers: int = 2) -> Path:
    """A random-weight Llama whose head dim (hidden / heads) the CUDA decode kernels take, saved under
    tmp_path (the tiny models of tests/conftest.py have head dim 8)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=320, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_pos,
                      initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(hidden)
    path = tmp_path / f"h{hidden}-l{layers}"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    return path


def make_engine(path: Path, **options):
    from mii_async.workers.engine import Engine

    return Engine(EngineConfig.from_kwargs(str(path), **options))


def three_decoding(engine, rng) -> None:
    """Three requests (50, 120 and 190 random prompt tokens) brought to decoding, with no id in flight: the
    next plan holds their three decodes (the bf16 logits tests compare a captured run of it with eager)."""
    for rid in range(3):
        engine.add_request(rid, [rng.randrange(3, 320) for _ in range(50 + 70 * rid)],
                           SamplingParams(max_new_tokens=4, ignore_eos=True))
    while any(len(s.output_ids) == s.num_pending for s in engine.seqs.values()):
        engine.step()
    engine.flush()                                    # no placeholder ids left: the plan runs on its own


def run_engine(engine, prompts: list[list[int]], **params) -> list[list[int]]:
    """Submits every prompt at once and steps until all finish; returns each one's output ids."""
    sp = SamplingParams(**params)
    base = 10_000 + engine.num_steps * 1000
    outs: dict[int, list[int]] = {base + i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(base + i, p, sp)
    while engine.has_work():
        for o in engine.step():
            outs[o.req_id].append(o.token_id)
        engine.block_manager.check_invariants(engine.seqs.values())
    assert engine.block_manager.num_free == engine.num_blocks, "KV blocks leaked"
    return [outs[base + i] for i in range(len(prompts))]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def rope_model(tmp_path: Path, kind: str, rope: dict) -> Path:
    """A random-weight 2-layer `kind` (llama, mistral or qwen2) of 128 positions with the rope parameters `rope`,
    saved under tmp_path (its QKV biases randomised, as the tiny models of tests/conftest.py)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind]
    cfg = cls(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=128, initializer_range=0.1, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, rope_parameters={"rope_theta": 10000.0, **rope})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / "rope-model"
    model.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())   # as given: without the defaults transformers
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope}   # filled in when it saved the config
    (path / "config.json").write_text(json.dumps(config))
    return path
