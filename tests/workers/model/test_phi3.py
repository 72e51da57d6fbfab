"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers on tiny random weights: fused qkv_proj and
gate_up_proj, LongRoPE's long factors (an engine context past the original one) and short ones (within it),
partial rotary, a sliding window; and its fused weights split over two tensor-parallel ranks (gloo)."""
from __future__ import annotations

import json

import pytest
import torch

from mii_async.errors import UnsupportedModelError

from .family_parity import SHAPE, check_parity, prompts_for, save_tiny

ORIGINAL = 64                   # the LongRoPE models' original context


def _phi3(tmp_path, partial: float = 1.0, window: int | None = 24, **cfg):
    from transformers import Phi3Config, Phi3ForCausalLM

    half = int(16 * partial) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]}
    config = Phi3Config(**{**SHAPE, "num_hidden_layers": 2, "rope_parameters": rope, "sliding_window": window,
                           "original_max_position_embeddings": ORIGINAL, **cfg})
    return save_tiny(Phi3ForCausalLM, config, tmp_path / f"phi3-{partial}")


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_phi3_long_context_matches_transformers(tmp_path, partial):
    """A context past the original 64 positions (max_model_len 256): prompts of 70–100 tokens, past the 24-token
    window too, rotated with LongRoPE's long factors as transformers rotates them, 32 greedy tokens and the
    logits equal to its, with the whole head rotated and (as Phi-4-mini) three quarters of it."""
    path = _phi3(tmp_path, partial)
    assert json.loads((path / "config.json").read_text())["rope_parameters"]["rope_type"] == "longrope"
    check_parity(path, prompts_for(f"phi3-{partial}", [70, 100, 81, 90]))


def test_phi3_original_context_matches_transformers(tmp_path):
    """An engine whose context is the original 64 positions (max_model_len 64) rotates with the short factors,
    as transformers does every sequence that fits it: prompts of 26–30 tokens and 32 greedy tokens."""
    path = _phi3(tmp_path, 0.75)
    check_parity(path, prompts_for("phi3-short", [30, 26, 28]), max_model_len=ORIGINAL)


def test_phi3_old_su_rope_and_no_window(tmp_path):
    """A Phi-3-128k config as the Hub wrote it (rope_scaling type "su", original_max_position_embeddings at the
    top level) and no sliding window: read as longrope, transformers' tokens."""
    path = _phi3(tmp_path, window=None)
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_scaling"] = {"type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
    cfg["rope_theta"] = 10000.0
    (path / "config.json").write_text(json.dumps(cfg))
    from mii_async.workers.model.loader import load_spec

    spec = load_spec(path)
    assert spec.rope_scaling["rope_type"] == "longrope" and spec.sliding_window is None
    assert spec.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    check_parity(path, prompts_for("phi3-su", [70, 90]))


def test_longrope_factors_of_the_wrong_length_are_refused(tmp_path):
    """short_factor must hold one factor per rotated frequency: another length is refused, naming it."""
    from mii_async.workers.model.loader import load_spec

    rope = {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "num_hidden_layers": 2, "model_type": "phi3",
                                                      "architectures": ["Phi3ForCausalLM"], "rope_scaling": rope}))
    with pytest.raises(UnsupportedModelError, match="short_factor"):
        load_spec(tmp_path)


def test_phi3_fused_weights_split_over_two_ranks(tmp_path):
    """TP=2 (gloo): each rank takes its q heads, its KV head and its FFN rows out of qkv_proj and gate_up_proj;
    logits within 1e-4 of TP=1 and the same greedy tokens, KV all freed."""
    from ..test_tensor_parallel import _run

    path = _phi3(tmp_path, 0.75)
    one, two = _run(path, 1, tmp_path), _run(path, 2, tmp_path)
    a, b = torch.tensor(one["logits"]), torch.tensor(two["logits"])
    assert ((a - b).norm() / a.norm()).item() < 1e-4
    assert one["greedy"] == two["greedy"]
    assert two["free"] == two["blocks"]
