"""The Llama family: Llama 2/3, Mistral and Qwen2 (q/k/v biases; tied embeddings in the small sizes; sliding
windows where the config sets them, in every layer for Mistral, in the layers it names for Qwen2).

Each layer is the shared attention (QKV fused at load, rotary, paged attention) and the SiLU-gated MLP (gate
and up fused), each with an RMSNorm before it. On CUDA the norm before a projection is its prologue and
SiLU-and-mul gate|up's epilogue (gemv.cu, at a few rows).
"""
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


class LlamaModel(DecoderModel):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    model_types = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

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
                                cos_sin, tp, window=spec.window_of(index)),
            mlp=GatedMLP.load(w, p + "mlp.", RMSNorm.load(w, p + "post_attention_layernorm.weight", eps), tp))
