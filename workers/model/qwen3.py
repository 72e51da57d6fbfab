"""Qwen3 (dense): the Llama layer with a per-head RMSNorm on q and on k before rotary, and no QKV bias
(attention_bias false, as its config class defaults it); sliding windows in the layers the config names
(use_sliding_window, then layer_types or max_window_layers), as Qwen2."""
from __future__ import annotations

from typing import Any

import torch

from .decoder import DecoderLayer, DecoderModel
from .layers.attention import Attention
from .layers.mlp import GatedMLP, check_silu_mlp
from .layers.norm import RMSNorm
from .parallel import TPGroup
from .spec import ModelSpec
from .weights import Weights


class Qwen3Model(DecoderModel):
    architectures = ("Qwen3ForCausalLM",)
    model_types = {"qwen3": "Qwen3ForCausalLM"}
    config_defaults = {"attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False,
                       "rope_theta": 10000.0, "rms_norm_eps": 1e-6}

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        check_silu_mlp(cfg)

    @classmethod
    def load_layer(cls, w: Weights, spec: ModelSpec, index: int, cos_sin: torch.Tensor,
                   tp: TPGroup | None) -> DecoderLayer:
        p = f"model.layers.{index}."
        eps = spec.rms_norm_eps
        return DecoderLayer(
            attn=Attention.load(w, p + "self_attn.", RMSNorm.load(w, p + "input_layernorm.weight", eps), spec,
                                cos_sin, tp, q_norm=RMSNorm.load(w, p + "self_attn.q_norm.weight", eps),
                                k_norm=RMSNorm.load(w, p + "self_attn.k_norm.weight", eps),
                                window=spec.window_of(index)),
            mlp=GatedMLP.load(w, p + "mlp.", RMSNorm.load(w, p + "post_attention_layernorm.weight", eps), tp))
