"""GatedMLP: down(act(gate(x)) · up(x)) over the normed residual stream, gate and up fused into one
projection; act is SiLU (SwiGLU: Llama, Qwen, Phi-3) or tanh-approximated GELU (GeGLU: Gemma). The checkpoint
holds gate_proj and up_proj, or one fused gate_up_proj (Phi-3: [gate rows | up rows]). Under tensor parallelism
gate|up is column-parallel (each rank holds F/T of the FFN rows, of gate and of up) and down row-parallel,
all-reduced. Under FP8 weights gate|up and down are FP8Weights, which the op set takes as dense ones."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..quantized_loading import LinearWeight
from mii_async.errors import UnsupportedModelError

from ..parallel import TPGroup
from ..weights import Weights
from .norm import RMSNorm

if TYPE_CHECKING:
    from mii_async.kernels.op_set import OpSet

ACTIVATIONS = ("silu", "gelu_tanh")


def check_silu_mlp(cfg: dict[str, Any], what: str = "the MLP", biases: bool = True) -> None:
    """Refuses, naming the field, a config whose MLP (or experts: `what`) is not what GatedMLP and the experts
    compute — SiLU-gated, and (`biases`: where the config can say so) without biases: it would load and run,
    wrongly."""
    if (act := cfg.get("hidden_act", "silu")) not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported: {what} is SiLU-gated (silu)")
    if biases and cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported: the MLP's projections have no biases here")


@dataclass
class GatedMLP:
    norm: RMSNorm                   # the norm before the MLP (post_attention_layernorm): gate|up's prologue
    gate_up: LinearWeight           # [2 F, H]: this rank's F rows of gate, then the same rows of up (or FP8)
    down: LinearWeight              # [H, F]: this rank's F columns (or FP8)
    tp: TPGroup | None
    act: str = "silu"               # the gate's activation: "silu" or "gelu_tanh"

    @classmethod
    def load(cls, w: Weights, prefix: str, norm: RMSNorm, tp: TPGroup | None, *, act: str = "silu",
             intermediate_size: int | None = None) -> GatedMLP:
        """gate_proj and up_proj, or the fused gate_up_proj (which needs `intermediate_size`, F), and down_proj
        under `prefix` (no biases: the architecture files refuse mlp_bias)."""
        assert act in ACTIVATIONS, f"unknown MLP activation {act!r}"
        ffn = w.shard.ffn if w.shard is not None else None
        fused = prefix + "gate_up_proj.weight"
        if fused in w:                  # [gate rows | up rows]: this rank's of each
            assert intermediate_size is not None, f"{fused} is split at intermediate_size, which was not given"
            f0, f1 = ffn if ffn is not None else (0, intermediate_size)
            gate_up = w.linear([(fused, (f0, f1), 1), (fused, (intermediate_size + f0, intermediate_size + f1), 1)])
        else:
            gate_up = w.linear([(prefix + "gate_proj.weight", ffn, 1), (prefix + "up_proj.weight", ffn, 1)])
        return cls(norm, gate_up, w.linear_columns(prefix + "down_proj.weight", ffn), tp, act)

    def __call__(self, ops: OpSet, h: torch.Tensor, residual: torch.Tensor,
                 pre_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (the attention's output, normed by `pre_norm` first: a post-norm) → the MLP's output [T, H],
        residual + h."""
        if self.act == "silu":
            if pre_norm is not None:
                h = ops.rms_norm(h, pre_norm.weight, pre_norm.eps)
            h, residual = ops.add_rms_norm_mlp(h, residual, self.norm.weight, self.norm.eps, self.gate_up,
                                               self.down)
        else:                           # GeGLU (Gemma): the post-norm is the GEMV's prologue
            extra = {"pre_norm": (pre_norm.weight, pre_norm.eps)} if pre_norm is not None else {}
            y, residual = ops.add_rms_norm_gate_up_gelu(h, residual, self.norm.weight, self.norm.eps, self.gate_up,
                                                        **extra)                 # act(gate) * up [T, F]
            h = ops.linear(y, self.down)
        if self.tp is not None:
            self.tp.all_reduce(h)                                               # row-parallel down
        return h, residual
