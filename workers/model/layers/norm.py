"""RMSNorm: a weight and an epsilon (Gemma's 1 + weight folded into the weight at load). It runs as the
prologue of the projection after it (`ops.add_rms_norm_linear`, `ops.add_rms_norm_gate_up`), which also adds the
block's input to the residual stream: on CUDA, at a few rows, one kernel for norm and GEMM."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..weights import Weights


@dataclass
class RMSNorm:
    weight: torch.Tensor            # [H], replicated on every rank
    eps: float

    @classmethod
    def load(cls, w: Weights, name: str, eps: float, offset: float = 0.0) -> RMSNorm:
        """The norm at `name`. `offset`: added to the weight in fp32 before it takes the model's dtype (Gemma
        scales by 1 + weight): the norm ops and their fused kernels then serve it unchanged."""
        if not offset:
            return cls(w.get(name), eps)
        return cls((w.source.get(name).float() + offset).to(device=w.device, dtype=w.dtype), eps)
