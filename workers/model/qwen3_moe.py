"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (a per-head RMSNorm on q and on k before
rotary, no QKV bias) with a mixture of experts in the place of the MLP in its sparse layers.

A layer is sparse unless `mlp_only_layers` lists it, one in every `decoder_sparse_step` counting from 1 (all of
them in the released models); there the MoE block (layers/moe.py) routes each token to `num_experts_per_tok` of
`num_experts` SwiGLU experts of `moe_intermediate_size`, renormalising the chosen weights when
`norm_topk_prob`. A dense layer keeps the gated MLP of `intermediate_size`. The checkpoint keeps the router as
`mlp.gate` and each expert as gate_proj, up_proj and down_proj under `mlp.experts.{e}.`.
"""
from __future__ import annotations

from typing import Any

import torch

from .decoder import DecoderLayer, DecoderModel
from .layers.attention import Attention
from .layers.mlp import GatedMLP, check_silu_mlp
from .layers.moe import ExpertNames, MoE
from .layers.norm import RMSNorm
from .parallel import TPGroup
from .spec import ModelSpec
from .weights import Weights

EXPERTS = ExpertNames(router="gate.weight", gate="experts.{e}.gate_proj.weight", up="experts.{e}.up_proj.weight",
                      down="experts.{e}.down_proj.weight")


class Qwen3MoeModel(DecoderModel):
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = {"qwen3_moe": "Qwen3MoeForCausalLM"}
    config_defaults = {"attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False,
                       "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_experts": 128, "num_experts_per_tok": 8,
                       "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1}

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        check_silu_mlp(cfg, "the experts")

    @classmethod
    def load_layer(cls, w: Weights, spec: ModelSpec, index: int, cos_sin: torch.Tensor,
                   tp: TPGroup | None) -> DecoderLayer:
        p = f"model.layers.{index}."
        eps = spec.rms_norm_eps
        attn = Attention.load(w, p + "self_attn.", RMSNorm.load(w, p + "input_layernorm.weight", eps), spec,
                              cos_sin, tp, q_norm=RMSNorm.load(w, p + "self_attn.q_norm.weight", eps),
                              k_norm=RMSNorm.load(w, p + "self_attn.k_norm.weight", eps), window=spec.window_of(index))
        norm = RMSNorm.load(w, p + "post_attention_layernorm.weight", eps)
        if spec.moe is not None and spec.moe.is_sparse(index):
            return DecoderLayer(attn=attn, mlp=MoE.load(w, p + "mlp.", norm, spec.moe, EXPERTS, tp))
        return DecoderLayer(attn=attn, mlp=GatedMLP.load(w, p + "mlp.", norm, tp))
