"""Gemma 2 and Gemma 3 (text): the decoder with Gemma's differences, each one a shared block's option.

- RMSNorm scales by (1 + weight): the 1 is folded into every norm's weight at load (`norm_offset`), so the norm
  ops and their fused CUDA kernels serve it unchanged.
- Norms before and after each block: input_layernorm before attention, post_attention_layernorm on its output
  before it joins the residual stream; pre_feedforward_layernorm before the MLP, post_feedforward_layernorm
  on its output.
- GeGLU: gelu (tanh approximation) on the gate.
- Embeddings times sqrt(hidden_size), the factor rounded to the activations' dtype as transformers rounds it.
- The softmax scale is query_pre_attn_scalar ** -0.5.
- Gemma 2: attention logits soft-capped (attn_logit_softcapping) and final logits (final_logit_softcapping);
  sliding-window layers alternate with global ones (every other layer global).
- Gemma 3: per-head RMSNorm on q and k before rotary; five sliding layers to one global (or as layer_types
  says), the sliding ones with their own rope base (rope_local_base_freq), the global ones with the model's
  rope (rope_theta, and its scaling); no soft-capping unless the config sets it.
- Tied embeddings.

Refused, naming the field: another activation (hidden_activation), bidirectional attention
(use_bidirectional_attention: Gemma 3 as an embedding model), and Gemma 3's multimodal checkpoints
(Gemma3ForConditionalGeneration: not a text-only architecture).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from mii_async.errors import UnsupportedModelError

from .decoder import DecoderLayer, DecoderModel
from .layers.attention import Attention
from .layers.mlp import GatedMLP
from .layers.norm import RMSNorm
from .parallel import TPGroup
from .spec import ModelSpec
from .weights import Weights

GELU_TANH = ("gelu_pytorch_tanh",)      # transformers' names of the tanh-approximated gelu that Gemma uses


class _Gemma(DecoderModel):
    norm_offset = 1.0
    qk_norm: ClassVar[bool] = False     # per-head q and k norms (Gemma 3)

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        field = "hidden_activation" if cfg.get("hidden_activation") is not None else "hidden_act"
        act = cfg.get(field) or GELU_TANH[0]
        if act not in GELU_TANH:
            raise UnsupportedModelError(f"{field} {act!r} is not supported: Gemma's MLP is gelu-tanh gated "
                                        f"({', '.join(GELU_TANH)})")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention=true is not supported: the layers attend "
                                        "causally")

    @classmethod
    def embedding_scale(cls, spec: ModelSpec) -> float | None:
        return spec.hidden_size ** 0.5

    @classmethod
    def load_layer(cls, w: Weights, spec: ModelSpec, index: int, cos_sin: torch.Tensor,
                   tp: TPGroup | None) -> DecoderLayer:
        p = f"model.layers.{index}."

        def norm(name: str) -> RMSNorm:
            return RMSNorm.load(w, p + name, spec.rms_norm_eps, cls.norm_offset)

        qk = dict(q_norm=norm("self_attn.q_norm.weight"), k_norm=norm("self_attn.k_norm.weight")) if cls.qk_norm else {}
        return DecoderLayer(
            attn=Attention.load(w, p + "self_attn.", norm("input_layernorm.weight"), spec, cos_sin, tp,
                                window=spec.window_of(index), **qk),
            mlp=GatedMLP.load(w, p + "mlp.", norm("pre_feedforward_layernorm.weight"), tp, act="gelu_tanh"),
            post_attn_norm=norm("post_attention_layernorm.weight"),
            post_mlp_norm=norm("post_feedforward_layernorm.weight"))


class Gemma2Model(_Gemma):
    architectures = ("Gemma2ForCausalLM",)
    model_types = {"gemma2": "Gemma2ForCausalLM"}
    config_defaults = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                       "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
                       "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192}


class Gemma3Model(_Gemma):
    architectures = ("Gemma3ForCausalLM",)
    model_types = {"gemma3_text": "Gemma3ForCausalLM"}
    qk_norm = True
    config_defaults = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                       "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                       "rms_norm_eps": 1e-6, "max_position_embeddings": 131_072}
