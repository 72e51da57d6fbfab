"""Reading config.json: what the layers cannot compute is refused before any weight is read, naming the field;
what transformers accepts with a default is read with that default."""
from __future__ import annotations

import json

import pytest

from mii_async.errors import UnsupportedModelError
from mii_async.workers.model.loader import load_spec

LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 160,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}


def _spec(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **cfg}))   # no weights: the spec alone is read
    return load_spec(tmp_path)


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("kind", ["dynamic", "no-such-rope"])
def test_unsupported_rope_type_is_refused_naming_the_field(tmp_path, field, kind):
    """A rope type the model does not implement is refused when config.json is read, naming its field."""
    rope = {"rope_type": kind, "factor": 2.0, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 256}
    with pytest.raises(UnsupportedModelError, match=f"{field}.*{kind}"):
        _spec(tmp_path, **{field: rope})


def test_rope_missing_a_parameter_is_refused_naming_it(tmp_path):
    """A llama3 / linear rope without a parameter transformers requires names the parameter (not a KeyError)."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "rope_theta": 500000.0}
    with pytest.raises(UnsupportedModelError, match="rope_parameters.low_freq_factor"):
        _spec(tmp_path, rope_parameters=llama3)
    with pytest.raises(UnsupportedModelError, match="rope_scaling.factor"):
        _spec(tmp_path, rope_scaling={"type": "linear"})


def test_rope_defaults_follow_transformers(tmp_path):
    """A v4 config's top-level rope_theta and old `type` key are read; llama3 and yarn without
    original_max_position_embeddings take the model's max_position_embeddings (a top-level one first)."""
    spec = _spec(tmp_path, rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert spec.rope_theta == 500000.0 and spec.rope_scaling["factor"] == 2.0
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert _spec(tmp_path, rope_parameters=llama3).rope_scaling["original_max_position_embeddings"] == 1024
    spec = _spec(tmp_path, rope_parameters=llama3, original_max_position_embeddings=512)
    assert spec.rope_scaling["original_max_position_embeddings"] == 512
    assert _spec(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0}).rope_scaling[
        "original_max_position_embeddings"] == 1024
    assert _spec(tmp_path).rope_scaling is None and _spec(tmp_path).rope_theta == 10000.0


def test_yarn_stretches_the_position_limit(tmp_path):
    """A YaRN rope takes original × factor positions (Qwen2.5's 32k × 4), as vLLM derives it; other ropes keep
    max_position_embeddings."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert _spec(tmp_path, rope_scaling=yarn).max_position_embeddings == 4096
    assert _spec(tmp_path, rope_scaling={**yarn, "factor": 0.5}).max_position_embeddings == 1024
    assert _spec(tmp_path, rope_scaling={"type": "linear", "factor": 4.0}).max_position_embeddings == 1024


def test_qwen2_window_only_where_a_layer_slides(tmp_path):
    """Qwen2 slides only in layers from max_window_layers on (or as layer_types says): with none, the context is
    not capped at the window; with one, it is."""
    qwen = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 48}
    assert _spec(tmp_path, **qwen, max_window_layers=2).sliding_window is None
    assert _spec(tmp_path, **qwen, max_window_layers=1).sliding_window == 48
    assert _spec(tmp_path, **qwen, layer_types=["full_attention"] * 2).sliding_window is None
    assert _spec(tmp_path, **qwen, max_window_layers=2,
                 layer_types=["full_attention", "sliding_attention"]).sliding_window == 48
    assert _spec(tmp_path, **{**qwen, "use_sliding_window": False}, max_window_layers=0).sliding_window is None
    assert _spec(tmp_path, model_type="mistral", sliding_window=48).sliding_window == 48


def test_a_missing_output_head_is_the_embedding_with_a_warning(tmp_path, caplog):
    """tie_word_embeddings false but no lm_head.weight in the checkpoint: the embedding serves as the head (the
    useful choice; transformers would start a random one), and the log says so."""
    import logging

    from safetensors.torch import load_file, save_file

    from ..helpers import head_dim_model, make_engine

    path = head_dim_model(tmp_path, 64, 8, 4, 256)
    weights = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" in weights
    del weights["lm_head.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="mii_async.workers.model.loader"):
        engine = make_engine(path, num_blocks=8, block_size=16)
    assert "no lm_head.weight" in caplog.text
    assert engine.runner.model.lm_head is engine.runner.model.embed
