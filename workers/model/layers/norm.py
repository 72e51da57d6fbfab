"""RMSNorm: a weight and an epsilon. It runs as the prologue of the projection after it
(`ops.add_rms_norm_linear`, `ops.add_rms_norm_gate_up`), which also adds the block's input to the residual
stream: on CUDA, at a few rows, one kernel for norm and GEMM."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..weights import Weights


@dataclass
class RMSNorm:
    weight: torch.Tensor            # [H], replicated on every rank
    eps: float

    @classmethod
    def load(cls, w: Weights, name: str, eps: float) -> RMSNorm:
        return cls(w.get(name), eps)
