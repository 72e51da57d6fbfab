"""MoESpec: the mixture-of-experts part of a config.json (Mixtral, Qwen3-MoE), as plain values, no torch.

A sparse layer replaces the gated MLP by E experts (each a SwiGLU of `moe_intermediate_size`) and a router
that sends every token to its `top_k` highest-scoring experts, weighted by the softmax of the router logits
(taken over all E, then renormalised over the chosen k when `norm_topk_prob`). The other layers keep the
dense MLP of `intermediate_size`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mii_async.errors import UnsupportedModelError


@dataclass(frozen=True)
class MoESpec:
    num_experts: int                # E: experts in every sparse layer
    top_k: int                      # experts each token is sent to (config num_experts_per_tok)
    moe_intermediate_size: int      # F of one expert's SwiGLU (Mixtral: intermediate_size)
    norm_topk_prob: bool            # the chosen k weights renormalised to sum to 1 (Mixtral always)
    sparse_layers: frozenset[int]   # the layer indices whose MLP is the experts; the others are dense

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def _experts(cfg: dict[str, Any]) -> int:
    # transformers writes Qwen3-MoE's `num_experts` as `num_local_experts` (its attribute map); hub configs
    # carry `num_experts`.
    return int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)


def moe_spec(cfg: dict[str, Any]) -> MoESpec | None:
    """The experts of a config.json, or None for a dense model (no expert count). Raises UnsupportedModelError,
    naming the field, for a count that cannot route."""
    num_experts = _experts(cfg)
    if num_experts <= 0:
        return None
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= num_experts:
        raise UnsupportedModelError(f"num_experts_per_tok {cfg.get('num_experts_per_tok')!r} must be between 1 and "
                                    f"the {num_experts} experts")
    layers = int(cfg["num_hidden_layers"])
    archs = cfg.get("architectures") or []
    mixtral = cfg.get("model_type") == "mixtral" or "MixtralForCausalLM" in archs
    if mixtral:                     # every layer sparse; the router always renormalises (transformers' Mixtral)
        return MoESpec(num_experts, top_k, int(cfg["intermediate_size"]), True, frozenset(range(layers)))
    # Qwen3-MoE, as transformers builds its layers: sparse unless listed in mlp_only_layers, every
    # decoder_sparse_step-th layer counting from 1.
    step = int(cfg.get("decoder_sparse_step") or 1)
    if step <= 0:
        raise UnsupportedModelError(f"decoder_sparse_step {step} must be positive")
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    sparse = frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if "moe_intermediate_size" not in cfg:
        raise UnsupportedModelError("moe_intermediate_size is missing from config.json: the experts' FFN size "
                                    "of a mixture-of-experts model")
    return MoESpec(num_experts, top_k, int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False)),
                   sparse)
