"""ModelSpec: the shapes and constants of a model, read from its config.json (loader.py). Plain values, no torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .moe_spec import MoESpec


@dataclass(frozen=True)
class ModelSpec:
    architecture: str               # the class that runs it (registry.py): config.json's architectures[0], or
                                    # the one its model_type stands for when the config names none
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool            # q/k/v projections carry a bias (Qwen2)
    eos_token_ids: frozenset[int]   # config + generation_config
    bos_token_id: int | None
    sliding_window: int | None      # the window of the layers that slide: a query attends to the last this many
                                    # positions, itself included; None: every layer attends to the whole context
    layer_types: tuple[str, ...] = ()   # per layer, transformers' "sliding_attention" | "full_attention"; (): every
                                        # layer slides where sliding_window is set (Mistral, Phi-3)
    rotary_dim: int = 0             # the leading dims of a head that rotary turns (partial_rotary_factor); 0: all
    local_rope_theta: float | None = None   # the sliding layers' own rope base, default rope (Gemma 3's
                                            # rope_local_base_freq); None: they share the model's rope
    attention_scale: float | None = None    # the softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_logit_softcap: float | None = None     # attention scores → cap·tanh(score / cap) before the softmax
    final_logit_softcap: float | None = None    # logits → cap·tanh(logit / cap) (Gemma 2)
    moe: MoESpec | None = None      # the experts of a mixture-of-experts model (moe_spec.py); None: dense

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None where it attends to the whole context."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5
