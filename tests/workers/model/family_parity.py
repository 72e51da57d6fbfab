"""Parity of an architecture file with transformers on the same tiny random weights: greedy tokens of several
prompts longer than the sliding window, run batched, chunked and over prefix-cached blocks, and the logits of
a whole prompt's last position."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from mii_async.params import SamplingParams

from ..helpers import make_engine, run_engine

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)


def save_tiny(model_class: Any, config: Any, path: Path, seed: int = 0, noise: float = 0.1) -> Path:
    """`model_class(config)` with random weights (its norms and biases moved off their initial values, so that
    they count) saved under `path` by transformers."""
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * noise)
    model.save_pretrained(str(path))
    return path


def prompts_for(seed: str, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in lengths]


def hf_reference(path: Path, dtype: Any = None, device: str = "cpu") -> Any:
    """transformers' model of `path` as the reference: in eager attention where the config soft-caps attention
    scores (Gemma 2), the one attention of transformers that applies the cap (its SDPA path leaves it out)."""
    import json

    from transformers import AutoModelForCausalLM

    cfg = json.loads((Path(path) / "config.json").read_text())
    extra = {"attn_implementation": "eager"} if cfg.get("attn_logit_softcapping") else {}
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32, **extra).to(device).eval()


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, `n` tokens, on the model's device: each token the argmax
    of its forward over the whole sequence (no cache), EOS masked throughout (min_new_tokens=n), as the engine's
    requests with `min_new_tokens` mask it."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, use_cache=False)
    return out[0, len(prompt):].tolist()


def check_parity(path: Path, prompts: list[list[int]], new_tokens: int = 32, tol: float = 1e-4,
                 device: str = "cpu", ref_device: str | None = None, **engine_options: Any) -> float:
    """Our engine (fp32, 16-token blocks, prefix caching on, steps of at most 64 tokens so that prompts are
    chunked; on `device`, the CPU unless given) against transformers on `ref_device` (the same device unless
    given): every prompt's greedy continuation, batched; then each prompt's second half behind the first half of
    the first prompt (its blocks cached by then); the logits of the first prompt's last position. Returns that
    logits' relative error (asserted below `tol`)."""
    hf = hf_reference(path, device=ref_device or device)
    options = dict(num_blocks=128, block_size=16, max_batch_tokens=64, max_num_seqs=8, enable_prefix_caching=True,
                   device=device)
    engine = make_engine(path, **{**options, **engine_options})
    ours = run_engine(engine, prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    for p, o in zip(prompts, ours):
        assert o == greedy(hf, p, new_tokens), f"greedy tokens differ for a prompt of {len(p)} tokens"
    shared = prompts[0][:len(prompts[0]) // 2 // 16 * 16 + 16]       # whole cached blocks, and one more token
    again = [shared + p[len(p) // 2:] for p in prompts[1:]]
    hits = engine.block_manager.stats().hit_tokens
    ours = run_engine(engine, again, max_new_tokens=new_tokens // 2, min_new_tokens=new_tokens // 2)
    assert engine.block_manager.stats().hit_tokens - hits >= len(again) * (len(shared) // 16 * 16), \
        "the shared prefix was not served from the cache"
    for p, o in zip(again, ours):
        assert o == greedy(hf, p, new_tokens // 2), "greedy tokens differ over prefix-cached blocks"
    engine.add_request(1, prompts[0], SamplingParams(max_new_tokens=1))
    logits = engine.runner.execute(engine.scheduler.schedule())[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]], device=hf.device)).logits[0, -1].to(logits.device)
    err = (torch.linalg.norm(logits - ref) / torch.linalg.norm(ref)).item()
    assert err < tol, f"logits' relative error {err:.2e}"
    return err
