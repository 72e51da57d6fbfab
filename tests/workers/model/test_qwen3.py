"""Qwen3 (per-head q/k RMSNorm, no QKV bias) against transformers on tiny random weights, with and without
sliding-window layers."""
from __future__ import annotations

import pytest

from .family_parity import SHAPE, check_parity, prompts_for, save_tiny


def _qwen3(tmp_path, **cfg):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**SHAPE, "num_hidden_layers": 3, **cfg})
    return save_tiny(Qwen3ForCausalLM, config, tmp_path / "qwen3")


@pytest.mark.parametrize("window", [None, 24])
def test_qwen3_matches_transformers(tmp_path, window):
    """Greedy tokens over 32 steps and last-position logits equal transformers' for prompts of 40–100 tokens,
    batched, chunked and over cached prefixes; with use_sliding_window, layers from max_window_layers on attend
    to their last 24 positions and the others to the whole context."""
    extra = dict(use_sliding_window=True, sliding_window=window, max_window_layers=1) if window else {}
    path = _qwen3(tmp_path, tie_word_embeddings=window is None, **extra)
    check_parity(path, prompts_for(f"qwen3-{window}", [40, 71, 100, 55]))


def test_qwen3_spec_reads_its_norms_and_windows(tmp_path):
    """The spec of a Qwen3 with use_sliding_window names the window and which layers slide."""
    from mii_async.workers.model.loader import load_spec
    from mii_async.workers.model.registry import model_class
    from mii_async.workers.model.qwen3 import Qwen3Model

    path = _qwen3(tmp_path, use_sliding_window=True, sliding_window=24, max_window_layers=1)
    spec = load_spec(path)
    assert model_class(spec) is Qwen3Model
    assert [spec.window_of(i) for i in range(3)] == [None, 24, 24]
    assert not spec.attention_bias
