"""Phi-3 and Phi-4 (Phi3ForCausalLM: Phi-3, Phi-3.5-mini, Phi-4-mini, Phi-4): the Llama layer with its
projections fused in the checkpoint, and LongRoPE.

- qkv_proj holds [q heads | k heads | v heads] and gate_up_proj [gate rows | up rows]: under tensor parallelism
  each rank reads its q heads, its KV heads and its FFN rows out of them (layers/attention.py, layers/mlp.py),
  never the whole tensor.
- LongRoPE ("longrope", or the old "su"): short and long frequency factors with LongRoPE's attention factor
  (rope.py says which positions take which); partial rotary (Phi-4-mini turns 3/4 of each head).
- A sliding window, where the config sets one (Phi-3-mini-4k), in every layer.
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


class Phi3Model(DecoderModel):
    architectures = ("Phi3ForCausalLM",)
    model_types = {"phi3": "Phi3ForCausalLM"}
    config_defaults = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 10000.0,
                       "max_position_embeddings": 4096}

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        check_silu_mlp(cfg, biases=False)

    @classmethod
    def load_layer(cls, w: Weights, spec: ModelSpec, index: int, cos_sin: torch.Tensor,
                   tp: TPGroup | None) -> DecoderLayer:
        p = f"model.layers.{index}."
        eps = spec.rms_norm_eps
        return DecoderLayer(
            attn=Attention.load(w, p + "self_attn.", RMSNorm.load(w, p + "input_layernorm.weight", eps), spec,
                                cos_sin, tp, window=spec.window_of(index)),
            mlp=GatedMLP.load(w, p + "mlp.", RMSNorm.load(w, p + "post_attention_layernorm.weight", eps), tp,
                              intermediate_size=spec.intermediate_size))
