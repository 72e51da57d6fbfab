"""MoE: a sparse layer's mixture of experts in the place of the gated MLP. A router sends each token to its k
best-scoring experts (softmax top-k); each expert is a SwiGLU, down(silu(gate(x)) · up(x)), and a token's output
is its experts' outputs summed with the routing weights. The call is GatedMLP's: the residual add and the
RMSNorm before it are its prologue, and the op set takes all of it as one op (`ops.add_rms_norm_moe`), so that a
decode step's kernels may fuse the norm into the router and the routing into the experts.

The experts' weights are stacked, gate and up fused per expert: gate_up [E, 2F, H] and down [E, H, F], the
layout that the grouped GEMMs on CUDA read one expert's slice of. Under tensor parallelism every rank holds F/T
of every expert's FFN rows (the same rows of gate and up, those columns of down) and the whole router, so that
every rank routes alike; the partial outputs are all-reduced, as the dense MLP's row-parallel down is.

Under FP8 weights (workers/model/quantization.py) the experts and the router stay in the model dtype: an FP8
checkpoint's experts are dequantized as each one loads (weights.py), and `quantization="fp8"` leaves them as
they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mii_async.errors import UnsupportedModelError

from ..moe_spec import MoESpec
from ..parallel import TPGroup
from ..shard_plan import expert_ffn
from ..weights import Weights
from .norm import RMSNorm

if TYPE_CHECKING:
    from mii_async.kernels.op_set import OpSet


@dataclass(frozen=True)
class ExpertNames:
    """Where a checkpoint keeps a sparse layer's tensors, under the layer's MoE prefix; `{e}`: the expert."""
    router: str                     # [E, H]
    gate: str                       # [F, H] of expert e
    up: str                         # [F, H]
    down: str                       # [H, F]


@dataclass
class MoE:
    norm: RMSNorm                   # the norm before the experts (post_attention_layernorm): the router's prologue
    router: torch.Tensor            # [E, H], replicated on every rank
    gate_up: torch.Tensor           # [E, 2F, H]: this rank's F rows of each expert's gate, then the same rows of up
    down: torch.Tensor              # [E, H, F]: this rank's F columns of each expert's down
    top_k: int                      # experts per token
    renormalize: bool               # the k chosen weights divided by their sum
    tp: TPGroup | None

    @classmethod
    def load(cls, w: Weights, prefix: str, norm: RMSNorm, moe: MoESpec, names: ExpertNames,
             tp: TPGroup | None) -> MoE:
        """The router and the moe.num_experts experts under `prefix`, stacked into gate_up and down (one expert
        at a time, so that loading holds one expert's tensors beside the stacks)."""
        span = expert_ffn(w.shard, moe.moe_intermediate_size) if w.shard is not None else None
        f = span[1] - span[0] if span is not None else moe.moe_intermediate_size
        router = w.get(prefix + names.router)
        e, h = router.shape
        if e != moe.num_experts:
            raise UnsupportedModelError(f"{prefix}{names.router} routes to {e} experts, config.json's expert count "
                                        f"is {moe.num_experts}")
        gate_up = torch.empty((e, 2 * f, h), dtype=w.dtype, device=w.device)
        down = torch.empty((e, h, f), dtype=w.dtype, device=w.device)
        for i in range(e):
            gate_up[i, :f] = w.rows(prefix + names.gate.format(e=i), span)
            gate_up[i, f:] = w.rows(prefix + names.up.format(e=i), span)
            down[i] = w.columns(prefix + names.down.format(e=i), span)
        return cls(norm, router, gate_up, down, moe.top_k, moe.norm_topk_prob, tp)

    def __call__(self, ops: OpSet, h: torch.Tensor, residual: torch.Tensor | None,
                 pre_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (the attention's output, normed by `pre_norm` first: a post-norm) → the experts' output
        [T, H], residual + h."""
        if pre_norm is not None:
            h = ops.rms_norm(h, pre_norm.weight, pre_norm.eps)
        out, residual = ops.add_rms_norm_moe(h, residual, self.norm.weight, self.norm.eps, self.router, self.gate_up,
                                             self.down, self.top_k, self.renormalize)
        if self.tp is not None:
            self.tp.all_reduce(out)                                                     # each rank's F/T
        return out, residual
