"""Qwen3-MoE against transformers on the same random weights (8 experts, top-2, with and without renormalising the
chosen weights, a dense layer among the sparse ones), on the CPU: greedy tokens, logits, prefix caching, and TP=2
equal to TP=1."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from mii_async.params import SamplingParams

from ..helpers import hf_greedy, make_engine, run_engine


def build_qwen3_moe(path: Path, **overrides) -> Path:
    """A 3-layer random-weight Qwen3-MoE (8 experts of FFN 48, top-2; layer 1 dense, FFN 96; head_dim 16 ≠
    hidden/heads) saved with transformers' save_pretrained; norms randomised, the q/k norms included."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**{"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48,
                            "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
                            "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1],
                            "max_position_embeddings": 1024, "initializer_range": 0.1, "bos_token_id": 1,
                            "eos_token_id": 2, "pad_token_id": 0, **overrides})
    torch.manual_seed(30)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """norm_topk_prob → the model's directory and transformers' model on it, built once each."""
    made: dict[bool, tuple[Path, object]] = {}

    def get(norm_topk_prob: bool) -> tuple[Path, object]:
        from transformers import AutoModelForCausalLM

        if norm_topk_prob not in made:
            path = build_qwen3_moe(tmp_path_factory.mktemp(f"tiny-qwen3-moe-{norm_topk_prob}"),
                                   norm_topk_prob=norm_topk_prob)
            made[norm_topk_prob] = path, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        return made[norm_topk_prob]

    return get


def test_spec_reads_sparse_and_dense_layers(tmp_path):
    """load_spec's experts: num_experts (as hub configs spell it) or num_local_experts (as transformers saves it),
    mlp_only_layers dense, and decoder_sparse_step counting from 1."""
    from mii_async.workers.model.loader import load_spec
    from mii_async.workers.model.moe_spec import MoESpec

    shape = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 4, "architectures": ["Qwen3MoeForCausalLM"],
             "moe_intermediate_size": 48, "num_experts_per_tok": 2}
    for cfg, moe in (({"num_experts": 8, "norm_topk_prob": True}, MoESpec(8, 2, 48, True, frozenset({0, 1, 2, 3}))),
                     ({"num_local_experts": 8, "mlp_only_layers": [0, 3]}, MoESpec(8, 2, 48, False, frozenset({1, 2}))),
                     ({"num_experts": 8, "decoder_sparse_step": 2}, MoESpec(8, 2, 48, False, frozenset({1, 3})))):
        (tmp_path / "config.json").write_text(json.dumps({**shape, **cfg}))
        assert load_spec(tmp_path).moe == moe, cfg


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_greedy_and_logits_match_transformers(qwen3_moe, norm_topk_prob):
    """Four prompts batched: 32 greedy tokens each equal transformers', and a whole prompt's last logits are
    within 1e-4 relative error of transformers' forward, with the chosen weights renormalised and not."""
    path, hf = qwen3_moe(norm_topk_prob)
    rng = random.Random(f"qwen3-moe-{norm_topk_prob}")
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(5, 90))] for _ in range(4)]
    engine = make_engine(path, num_blocks=64, block_size=16)
    ours = run_engine(engine, prompts, max_new_tokens=32, min_new_tokens=32)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf, p, 32)
    engine.add_request(1, prompts[2], SamplingParams(max_new_tokens=1))
    logits = engine.runner.execute(engine.scheduler.schedule())[0]
    ref = hf(torch.tensor([prompts[2]])).logits[0, -1]
    assert torch.linalg.norm(logits - ref) / torch.linalg.norm(ref) < 1e-4


def test_prefix_cache_hits_give_the_same_tokens(qwen3_moe):
    """Prompts sharing a 48-token prefix, run after it is cached: their blocks come from the prefix cache
    (counted) and the greedy tokens are still transformers'."""
    path, hf = qwen3_moe(True)
    rng = random.Random(6)
    prefix = [rng.randrange(3, 320) for _ in range(48)]
    batch = [prefix + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    engine = make_engine(path, num_blocks=64, block_size=16)
    run_engine(engine, [batch[0]], max_new_tokens=1)
    hits = engine.stats()["prefix_hit_tokens"]
    ours = run_engine(engine, batch, max_new_tokens=16, min_new_tokens=16)
    assert engine.stats()["prefix_hit_tokens"] - hits >= 3 * 48
    for p, o in zip(batch, ours):
        assert o == hf_greedy(hf, p, 16)


def test_tp2_equals_tp1(qwen3_moe, tmp_path):
    """TP=2 (gloo; half of every expert's FFN and of the dense layer's on each rank): logits within 1e-4
    relative error of TP=1 and identical greedy tokens; every KV block freed."""
    from ..test_tensor_parallel import _run

    path, _ = qwen3_moe(False)
    one, two = _run(path, 1, tmp_path), _run(path, 2, tmp_path)
    a, b = torch.tensor(one["logits"]), torch.tensor(two["logits"])
    assert ((a - b).norm() / a.norm()).item() < 1e-4
    assert one["greedy"] == two["greedy"]
    assert two["free"] == two["blocks"]
