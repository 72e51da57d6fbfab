"""Gemma 2 and Gemma 3 (text) against transformers on tiny random weights: (1 + weight) norms before and after
each block, GeGLU, scaled embeddings, query_pre_attn_scalar, soft-capping, sliding layers among global ones,
Gemma 3's per-head q/k norms and its sliding layers' own rope base."""
from __future__ import annotations

import json

import pytest

from mii_async.errors import UnsupportedModelError

from .family_parity import SHAPE, check_parity, prompts_for, save_tiny

GEMMA = {**SHAPE, "num_hidden_layers": 4, "query_pre_attn_scalar": 24, "sliding_window": 24}


def _gemma2(tmp_path, **cfg):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**{**GEMMA, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, **cfg})
    return save_tiny(Gemma2ForCausalLM, config, tmp_path / "gemma2")


def _gemma3(tmp_path, **cfg):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    config = Gemma3TextConfig(**{**GEMMA, "rope_parameters": rope,
                                 "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                 "sliding_attention"], **cfg})
    return save_tiny(Gemma3ForCausalLM, config, tmp_path / "gemma3")


def test_gemma2_matches_transformers(tmp_path):
    """Gemma 2 with both soft-caps small enough to bite (2 on attention logits, 3 on final logits), every other
    layer sliding over 24 positions: greedy tokens and logits of prompts of 40–100 tokens."""
    path = _gemma2(tmp_path)
    check_parity(path, prompts_for("gemma2", [40, 71, 100, 55]))


def test_gemma3_matches_transformers(tmp_path):
    """Gemma 3: q/k norms, three sliding layers (local rope base 10k) around one global layer (rope base 1M
    with linear scaling): greedy tokens and logits."""
    path = _gemma3(tmp_path)
    check_parity(path, prompts_for("gemma3", [40, 71, 100, 55]))


def test_gemma3_config_of_the_hub_matches_transformers(tmp_path):
    """A Gemma 3 config.json as the Hub's (transformers v4) writes it: rope_theta, rope_local_base_freq,
    rope_scaling for the global layers, sliding_window_pattern instead of layer_types: read as transformers
    reads it (layers 0–4 sliding, 5 global)."""
    from mii_async.workers.model.loader import load_spec

    path = _gemma3(tmp_path, num_hidden_layers=6, layer_types=None)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        cfg.pop(key, None)
    cfg.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    (path / "config.json").write_text(json.dumps(cfg))
    spec = load_spec(path)
    assert [spec.window_of(i) for i in range(6)] == [24] * 5 + [None]
    assert spec.local_rope_theta == 10_000.0 and spec.rope_theta == 1_000_000.0
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    check_parity(path, prompts_for("gemma3-v4", [40, 90]))


@pytest.mark.parametrize("field,value,named", [
    ("hidden_activation", "gelu", "hidden_activation 'gelu'"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("final_logit_softcapping", -1.0, "final_logit_softcapping"),
])
def test_gemma_refuses_what_its_layers_do_not_compute(tmp_path, field, value, named):
    """Another activation, bidirectional attention, a soft-cap that is not positive: refused, naming the field."""
    from mii_async.workers.model.loader import load_spec

    cfg = {**GEMMA, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", field: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=named):
        load_spec(tmp_path)


def test_gemma3_multimodal_checkpoint_is_refused(tmp_path):
    """Gemma3ForConditionalGeneration (vision + text) is not run: refused naming it."""
    from mii_async.workers.model.loader import load_spec

    (tmp_path / "config.json").write_text(json.dumps({**GEMMA, "architectures": ["Gemma3ForConditionalGeneration"],
                                                      "model_type": "gemma3"}))
    with pytest.raises(UnsupportedModelError, match="Gemma3ForConditionalGeneration"):
        load_spec(tmp_path)
