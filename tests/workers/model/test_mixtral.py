"""Mixtral against transformers on the same random weights (8 experts, top-2, renormalised), on the CPU: greedy
tokens, logits, prefix caching, and TP=2 equal to TP=1."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from mii_async.params import SamplingParams

from ..helpers import hf_greedy, make_engine, run_engine


def build_mixtral(path: Path, **overrides) -> Path:
    """A 2-layer random-weight Mixtral (8 experts, top-2, GQA) saved with transformers' save_pretrained; its
    norms are randomised too, so that a norm loaded in the wrong place shows."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(**{"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                           "num_attention_heads": 8, "num_key_value_heads": 4, "num_local_experts": 8,
                           "num_experts_per_tok": 2, "max_position_embeddings": 1024, "initializer_range": 0.1,
                           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **overrides})
    torch.manual_seed(37)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return build_mixtral(tmp_path_factory.mktemp("tiny-mixtral"))


@pytest.fixture(scope="module")
def hf_mixtral(mixtral):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(mixtral), dtype=torch.float32).eval()


def _prompts(seed: str, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(5, 90))] for _ in range(n)]


def test_spec_reads_the_experts(mixtral):
    """load_spec fills spec.moe: 8 experts, top-2, the experts' FFN size, renormalised, every layer sparse."""
    from mii_async.workers.model.loader import load_spec
    from mii_async.workers.model.moe_spec import MoESpec
    from mii_async.workers.model.registry import model_class

    spec = load_spec(mixtral)
    assert spec.moe == MoESpec(8, 2, 96, True, frozenset({0, 1}))
    assert model_class(spec).__name__ == "MixtralModel"


def test_greedy_and_logits_match_transformers(mixtral, hf_mixtral):
    """Four prompts batched: 32 greedy tokens each equal transformers', and a whole prompt's last logits are
    within 1e-4 relative error of transformers' forward."""
    prompts = _prompts("mixtral")
    engine = make_engine(mixtral, num_blocks=64, block_size=16)
    ours = run_engine(engine, prompts, max_new_tokens=32, min_new_tokens=32)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf_mixtral, p, 32)
    engine.add_request(1, prompts[1], SamplingParams(max_new_tokens=1))
    logits = engine.runner.execute(engine.scheduler.schedule())[0]
    ref = hf_mixtral(torch.tensor([prompts[1]])).logits[0, -1]
    assert torch.linalg.norm(logits - ref) / torch.linalg.norm(ref) < 1e-4


def test_prefix_cache_hits_give_the_same_tokens(mixtral, hf_mixtral):
    """Prompts sharing a 48-token prefix, run after it is cached: their blocks come from the prefix cache
    (counted) and the greedy tokens are still transformers'."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 320) for _ in range(48)]
    batch = [prefix + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    engine = make_engine(mixtral, num_blocks=64, block_size=16)
    run_engine(engine, [batch[0]], max_new_tokens=1)
    hits = engine.stats()["prefix_hit_tokens"]
    ours = run_engine(engine, batch, max_new_tokens=16, min_new_tokens=16)
    assert engine.stats()["prefix_hit_tokens"] - hits >= 3 * 48
    for p, o in zip(batch, ours):
        assert o == hf_greedy(hf_mixtral, p, 16)


def test_mixtral_ignores_norm_topk_prob(tmp_path):
    """transformers' Mixtral always renormalises the chosen weights, whatever norm_topk_prob a config carries."""
    from mii_async.workers.model.loader import load_spec

    build_mixtral(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": False}))
    assert load_spec(tmp_path).moe.norm_topk_prob is True


def test_a_config_without_experts_is_refused_naming_the_field():
    """A Mixtral config.json without num_local_experts is refused, naming it, before any weight is read."""
    from mii_async.errors import UnsupportedModelError
    from mii_async.workers.model.registry import architecture_of

    with pytest.raises(UnsupportedModelError, match="num_local_experts"):
        architecture_of({"architectures": ["MixtralForCausalLM"], "num_experts_per_tok": 2})


def test_tp2_equals_tp1(mixtral, tmp_path):
    """TP=2 (gloo; each rank holds half of every expert's FFN): logits within 1e-4 relative error of TP=1 and
    identical greedy tokens; every KV block freed."""
    from ..test_tensor_parallel import _run

    one, two = _run(mixtral, 1, tmp_path), _run(mixtral, 2, tmp_path)
    a, b = torch.tensor(one["logits"]), torch.tensor(two["logits"])
    assert ((a - b).norm() / a.norm()).item() < 1e-4
    assert one["greedy"] == two["greedy"]
    assert two["free"] == two["blocks"]


def test_expert_ffn_must_split_evenly():
    """A tensor_parallel that does not divide the experts' FFN size is refused naming tensor_parallel and the
    size; one that does gives each rank its equal rows."""
    from mii_async.errors import InvalidParameterError
    from mii_async.workers.model.shard_plan import expert_ffn, shard_plan

    plan = shard_plan(8, 4, 160, 320, rank=1, world=2)
    assert expert_ffn(plan, 96) == (48, 96)
    with pytest.raises(InvalidParameterError, match="moe_intermediate_size 95") as e:
        expert_ffn(plan, 95)
    assert e.value.param == "tensor_parallel"
