"""ModelSpec: the shapes and constants of a model, read from its config.json (loader.py). Plain values, no torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    sliding_window: int | None      # when set, the usable context is capped at it (we attend densely)
