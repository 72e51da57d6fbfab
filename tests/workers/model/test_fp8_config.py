"""config.json's quantization_config: a format the engine does not load is refused when config.json is read,
naming the field and the format, before any weight is read; the FP8 formats it loads are read into their scheme."""
from __future__ import annotations

import json

import pytest

from mii_async.config import EngineConfig
from mii_async.errors import InvalidParameterError, UnsupportedModelError
from mii_async.workers.model.fp8_checkpoint import quantization_config
from mii_async.workers.model.loader import load_quantization, load_spec

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 64,
         "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
         "max_position_embeddings": 1024}


def _write(tmp_path, qc):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "quantization_config": qc}))
    # Not a safetensors file: a load that read any weight would fail on it rather than on the config.
    (tmp_path / "model.safetensors").write_bytes(b"not weights")
    return tmp_path


def _ct(weights=None, inputs="token", **top):
    qc = quantization_config("channel")
    group = qc["config_groups"]["group_0"]
    group["weights"].update(weights or {})
    if inputs is None:
        group["input_activations"] = None
    return {**qc, **top}


REFUSED = [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fbgemm_fp8"}, "quant_method 'fbgemm_fp8'"),
    (_ct(format="pack-quantized"), "quantization_config.format 'pack-quantized'"),
    (_ct(format="int-quantized"), "quantization_config.format 'int-quantized'"),
    (_ct(weights={"num_bits": 4, "type": "int"}), r"weights.num_bits/type \(4, 'int'\)"),
    (_ct(weights={"strategy": "group", "group_size": 128}), "weights.strategy 'group'"),
    (_ct(kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor"}), r"kv_cache_scheme.num_bits/type"),
    (_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "channel"}), "kv_cache_scheme.strategy"),
    (_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "dynamic": True}), "kv_cache_scheme.dynamic"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ("fp8", "quantization_config must be an object"),
]


@pytest.mark.parametrize("qc,match", REFUSED, ids=[m for _, m in REFUSED])
def test_unloadable_quantization_is_refused_naming_it(tmp_path, qc, match):
    """Each unsupported quantization_config is refused by load_spec with UnsupportedModelError naming the
    field (quantization_config.quant_method and the format, or the sub-field that does not fit)."""
    path = _write(tmp_path, qc)
    with pytest.raises(UnsupportedModelError, match=match) as info:
        load_spec(path)
    assert "quantization_config" in str(info.value)


def test_gptq_message_names_method_and_format(tmp_path):
    """The refusal of another method names quant_method and, where the config gives it, its format."""
    path = _write(tmp_path, {"quant_method": "compressed-tensors", "format": "pack-quantized"})
    with pytest.raises(UnsupportedModelError, match="format 'pack-quantized'"):
        load_spec(path)
    path = _write(tmp_path, {"quant_method": "hqq", "quant_type": "int4"})
    with pytest.raises(UnsupportedModelError, match=r"quant_method 'hqq' \(format 'int4'\)"):
        load_spec(path)


def test_engine_refuses_before_reading_weights(tmp_path):
    """Building an engine on such a checkpoint fails with the config's refusal, not on its (unreadable)
    weights file."""
    from mii_async.workers.engine import Engine

    path = _write(tmp_path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(UnsupportedModelError, match="quant_method 'gptq'"):
        Engine(EngineConfig.from_kwargs(str(path), device="cpu", num_blocks=8))


LOADED = [
    (quantization_config("channel"), ("compressed-tensors", "channel", "weight_scale", False)),
    (quantization_config("tensor", static_activations=True), ("compressed-tensors", "tensor", "weight_scale", True)),
    (_ct(inputs=None), ("compressed-tensors", "channel", "weight_scale", False)),
    (_ct(weights={"strategy": "block", "block_structure": [128, 128]}),
     ("compressed-tensors", "block", "weight_scale", False)),
    (quantization_config("block"), ("fp8-block", "block", "weight_scale_inv", False)),
]


@pytest.mark.parametrize("qc,want", LOADED, ids=[f"{w[0]}-{w[1]}" for _, w in LOADED])
def test_fp8_formats_are_read(tmp_path, qc, want):
    """The FP8 formats load_spec accepts give their scheme; `quantization` does not override a checkpoint's."""
    path = _write(tmp_path, qc)
    load_spec(path)
    for requested in (None, "fp8"):
        q = load_quantization(path, requested)
        assert (q.method, q.scales, q.scale_suffix, q.static_activations) == want


def test_quantization_option(tmp_path):
    """quantization="fp8" on a float checkpoint quantizes at load per channel; None loads it as it is; any
    other value is refused naming `quantization`."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert load_quantization(tmp_path, None) is None
    q = load_quantization(tmp_path, "fp8")
    assert q.at_load and q.scales == "channel"
    with pytest.raises(InvalidParameterError, match="quantization"):
        EngineConfig.from_kwargs(str(tmp_path), quantization="int8")
    assert load_quantization(tmp_path, "int4").integer
    assert EngineConfig.from_kwargs(str(tmp_path), quantization="fp8").model.quantization == "fp8"
    cfg = EngineConfig.from_kwargs(str(tmp_path), quantization="fp8")
    assert EngineConfig.from_dict(cfg.to_dict()).model.quantization == "fp8"   # the router → worker wire


def test_cli_serve_takes_quantization():
    """`mii-async serve --quantization fp8` (and int4) parses; another value is refused by argparse."""
    import argparse

    from mii_async.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers())
    assert parser.parse_args(["serve", "--quantization", "fp8"]).quantization == "fp8"
    assert parser.parse_args(["serve"]).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "int8"])
