"""Greedy parity with transformers on the same weights."""
from __future__ import annotations

import random

import pytest
import torch

from .helpers import hf_greedy, make_engine, run_engine

PROMPTS = ["The capital of France is", "def quicksort(arr):", "DeepSpeed-MII is a library for",
           "大模型推理部署的核心难点是", "Once upon a time, in a small village,"]


def test_default_model_matches_transformers(default_model_dir, hf_default):
    """The default model's greedy 32-token continuations equal transformers' for several prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    engine = make_engine(default_model_dir)
    ours = run_engine(engine, prompts, max_new_tokens=32, min_new_tokens=32)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf_default, p, 32)


@pytest.mark.parametrize("kind", ["llama", "llama3", "mistral", "qwen2"])
def test_tiny_models_match_transformers(tiny_model, kind):
    """Tiny random Llama / Llama-3-rope / Mistral / Qwen2 (bias, tied, GQA): greedy outputs and logits match."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(kind)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rng = random.Random(kind)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(5, 90))] for _ in range(4)]
    engine = make_engine(path, num_blocks=64, block_size=16)
    ours = run_engine(engine, prompts, max_new_tokens=40, min_new_tokens=40)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf, p, 40)
    # logits of a whole prompt's last position, one step, against transformers' forward
    engine.add_request(1, prompts[0], __import__("mii_async").SamplingParams(max_new_tokens=1))
    plan = engine.scheduler.schedule()
    logits = engine.runner.execute(plan)[0]
    ref = hf(torch.tensor([prompts[0]])).logits[0, -1]
    assert torch.linalg.norm(logits - ref) / torch.linalg.norm(ref) < 1e-4


ROPES = {
    # transformers defaults original_max_position_embeddings to max_position_embeddings
    "llama3-default-original": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0, "rope_theta": 500000.0}),
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn-params": ("llama", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                              "beta_fast": 16, "beta_slow": 2, "mscale": 2.0, "mscale_all_dim": 1.0, "truncate": False}),
    "yarn-attention-factor": ("mistral", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                                          "attention_factor": 1.5}),
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_scaling_matches_transformers(tmp_path, rope):
    """Llama-3 (original length defaulted), linear and YaRN rope (defaults, every parameter, an explicit attention
    factor): logits of a whole prompt, greedy tokens past the original length, as transformers computes them."""
    from transformers import AutoModelForCausalLM

    from .helpers import rope_model

    kind, params = ROPES[rope]
    path = rope_model(tmp_path, kind, params)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rng = random.Random(rope)
    prompt = [rng.randrange(3, 320) for _ in range(70)]
    engine = make_engine(path, num_blocks=32, block_size=16)
    assert run_engine(engine, [prompt], max_new_tokens=12, min_new_tokens=12)[0] == hf_greedy(hf, prompt, 12)
    engine.add_request(1, prompt, __import__("mii_async").SamplingParams(max_new_tokens=1))
    logits = engine.runner.execute(engine.scheduler.schedule())[0]
    ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert torch.linalg.norm(logits - ref) / torch.linalg.norm(ref) < 1e-5
