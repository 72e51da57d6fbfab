"""The model registry: config.json's `architectures[0]` picks the class, `model_type` stands in when a config
names no architectures, and anything else is refused by name with the supported list."""
from __future__ import annotations

import dataclasses
import json

import pytest

from mii_async.errors import UnsupportedModelError
from mii_async.workers.model.llama import LlamaModel
from mii_async.workers.model.loader import load_spec
from mii_async.workers.model.registry import architecture_of, model_class

SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}


def _spec(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, **cfg}))   # no weights: the spec alone is read
    return load_spec(tmp_path)


@pytest.mark.parametrize("arch,mtype", [("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"),
                                        ("Qwen2ForCausalLM", "qwen2")])
def test_the_llama_family_resolves_by_architecture(tmp_path, arch, mtype):
    """Llama, Mistral and Qwen2 configs, as transformers writes them, run on the Llama architecture file."""
    spec = _spec(tmp_path, architectures=[arch], model_type=mtype)
    assert spec.architecture == arch and spec.model_type == mtype
    assert model_class(spec) is LlamaModel


@pytest.mark.parametrize("mtype,arch", [("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
                                        ("qwen2", "Qwen2ForCausalLM")])
def test_model_type_stands_in_without_architectures(tmp_path, mtype, arch):
    """A config without `architectures` (GGUF-converted, hand-written) resolves through its model_type."""
    assert _spec(tmp_path, model_type=mtype).architecture == arch
    assert _spec(tmp_path, model_type=mtype, architectures=[]).architecture == arch


def test_architecture_without_model_type_is_enough(tmp_path):
    """`architectures` alone resolves, and the spec's model_type is the one that architecture stands for (Qwen2's
    sliding-window rule is read by it)."""
    spec = _spec(tmp_path, architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=48,
                 max_window_layers=2)
    assert spec.model_type == "qwen2" and spec.sliding_window is None


def test_unknown_architecture_is_refused_naming_it(tmp_path):
    """An architecture no file runs is refused naming it and listing the supported ones, even when its
    model_type is supported (a classification head on a Llama is not a causal LM)."""
    with pytest.raises(UnsupportedModelError) as e:
        _spec(tmp_path, architectures=["LlamaForSequenceClassification"], model_type="llama")
    msg = str(e.value)
    assert "'LlamaForSequenceClassification'" in msg
    assert all(a in msg for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"))


def test_unknown_model_type_is_refused_naming_it(tmp_path):
    """Without `architectures`, an unknown model_type (or none) is refused naming it and the supported ones."""
    for cfg, named in (({"model_type": "gpt2"}, "'gpt2'"), ({}, "None")):
        with pytest.raises(UnsupportedModelError) as e:
            _spec(tmp_path, **cfg)
        msg = str(e.value)
        assert f"model_type {named}" in msg
        assert all(t in msg for t in ("llama", "mistral", "qwen2", "LlamaForCausalLM"))


def test_the_architecture_checks_its_config_before_the_shapes_are_read():
    """The chosen class refuses the fields its layers do not compute, before a missing shape field matters."""
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        architecture_of({"architectures": ["MistralForCausalLM"], "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="mlp_bias"):
        architecture_of({"model_type": "llama", "mlp_bias": True})
    assert architecture_of({"architectures": ["LlamaForCausalLM"]}) == "LlamaForCausalLM"


def test_model_class_refuses_a_spec_of_an_unknown_architecture(tmp_path):
    """model_class, given a spec not made by load_spec, refuses an unknown architecture by name too."""
    spec = dataclasses.replace(_spec(tmp_path, model_type="llama"), architecture="GPT2LMHeadModel")
    with pytest.raises(UnsupportedModelError, match="'GPT2LMHeadModel'.*supported: LlamaForCausalLM"):
        model_class(spec)

