"""Mixtral: Mistral's attention with a mixture of experts in every layer's place of the MLP.

Each layer is the shared attention (QKV fused at load, rotary, paged attention; Mistral's sliding window where
the config sets one) and the MoE block (layers/moe.py): a router over `num_local_experts` SwiGLU experts, each
token sent to `num_experts_per_tok` of them with softmax weights that are always renormalised over the chosen
ones. The checkpoint keeps each expert as w1 (gate), w3 (up) and w2 (down) under `block_sparse_moe.`.
"""
from __future__ import annotations

from typing import Any

import torch

from mii_async.errors import UnsupportedModelError

from .decoder import DecoderLayer, DecoderModel
from .layers.attention import Attention
from .layers.mlp import check_silu_mlp
from .layers.moe import ExpertNames, MoE
from .layers.norm import RMSNorm
from .parallel import TPGroup
from .spec import ModelSpec
from .weights import Weights

EXPERTS = ExpertNames(router="gate.weight", gate="experts.{e}.w1.weight", up="experts.{e}.w3.weight",
                      down="experts.{e}.w2.weight")


class MixtralModel(DecoderModel):
    architectures = ("MixtralForCausalLM",)
    model_types = {"mixtral": "MixtralForCausalLM"}
    config_defaults = {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        # What the layers implement: SiLU-gated experts, a router over at least one of them.
        check_silu_mlp(cfg, "the experts", biases=False)
        if not cfg.get("num_local_experts"):
            raise UnsupportedModelError("num_local_experts is missing from config.json: a Mixtral routes to its "
                                        "experts")

    @classmethod
    def load_layer(cls, w: Weights, spec: ModelSpec, index: int, cos_sin: torch.Tensor,
                   tp: TPGroup | None) -> DecoderLayer:
        assert spec.moe is not None, "a Mixtral spec without its experts (load_spec fills spec.moe)"
        p = f"model.layers.{index}."
        eps = spec.rms_norm_eps
        return DecoderLayer(
            attn=Attention.load(w, p + "self_attn.", RMSNorm.load(w, p + "input_layernorm.weight", eps), spec,
                                cos_sin, tp, window=spec.window_of(index)),
            mlp=MoE.load(w, p + "block_sparse_moe.", RMSNorm.load(w, p + "post_attention_layernorm.weight", eps),
                         spec.moe, EXPERTS, tp))
