"""A prompt past the original context of a llama3-scaled rope (Llama 3.1: 8,192 positions stretched to 131,072)
on the CPU: our chunked prefill and decode give transformers' greedy tokens and last-position logits."""
from __future__ import annotations

import random

import torch

from mii_async.params import SamplingParams

from ..helpers import make_engine, run_engine
from .family_parity import greedy, hf_reference, save_tiny


def test_a_9k_prompt_past_the_original_context_matches_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=131072,
                      initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    path = save_tiny(LlamaForCausalLM, cfg, tmp_path / "llama31")
    rng = random.Random("long")
    prompt = [rng.randrange(3, 320) for _ in range(9000)]
    hf = hf_reference(path)
    engine = make_engine(path, max_model_len=9100, max_batch_tokens=1024)
    assert run_engine(engine, [prompt], max_new_tokens=8, min_new_tokens=8)[0] == greedy(hf, prompt, 8)
    engine.add_request(1, prompt, SamplingParams(max_new_tokens=1))
    logits = None
    while logits is None:
        plan = engine.scheduler.schedule()
        out = engine.runner.execute(plan)
        engine.scheduler.commit(engine.seqs[1], len(plan.seqs[0].token_ids))
        if plan.seqs[0].sample:
            logits = out[0].float()
    engine.abort(1)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]
    assert torch.linalg.norm(logits - ref) / torch.linalg.norm(ref) < 1e-4
