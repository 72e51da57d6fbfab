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
