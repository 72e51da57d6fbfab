"""GatedMLP: down(silu(gate(x)) · up(x)) over the normed residual stream, gate and up fused into one
projection. Under tensor parallelism gate|up is column-parallel (each rank holds F/T of the FFN rows) and down
row-parallel, all-reduced."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..parallel import TPGroup
from ..weights import Weights
from .norm import RMSNorm

if TYPE_CHECKING:
    from mii_async.kernels.op_set import OpSet


@dataclass
class GatedMLP:
    norm: RMSNorm                   # the norm before the MLP (post_attention_layernorm): gate|up's prologue
    gate_up: torch.Tensor           # [2 F, H]: this rank's F rows of gate, then the same rows of up
    down: torch.Tensor              # [H, F]: this rank's F columns
    tp: TPGroup | None

    @classmethod
    def load(cls, w: Weights, prefix: str, norm: RMSNorm, tp: TPGroup | None) -> GatedMLP:
        """gate_proj, up_proj and down_proj under `prefix` (no biases: load_spec refuses mlp_bias)."""
        ffn = w.shard.ffn if w.shard is not None else None
        gate_up = torch.cat([w.rows(prefix + "gate_proj.weight", ffn), w.rows(prefix + "up_proj.weight", ffn)], 0)
        return cls(norm, gate_up, w.columns(prefix + "down_proj.weight", ffn), tp)

    def __call__(self, ops: OpSet, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (the attention's output) → the MLP's output [T, H], residual + h."""
        act, residual = ops.add_rms_norm_gate_up(h, residual, self.norm.weight, self.norm.eps,
                                                 self.gate_up)                  # silu(gate) * up [T, F]
        h = ops.linear(act, self.down)
        if self.tp is not None:
            self.tp.all_reduce(h)                                               # row-parallel down
        return h, residual
