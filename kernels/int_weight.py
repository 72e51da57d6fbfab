"""Weight-only integer weights for the CPU: Int4Weight (the attention and MLP projections) and Int8Weight (the
output head), with the torch definitions of quantizing and dequantizing them.

At batch 1 a CPU decode step streams every weight once, so its time is the weights' bytes over the memory
bandwidth: 4-bit weights read a quarter of bf16's bytes and an eighth of fp32's. torch ships the CPU GEMMs for
both layouts (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`, oneDNN/AVX-512 inside); their fast paths
take bf16 activations, which is why `quantization="int4"` runs the model in bf16 (workers/engine_build.py).

Int4Weight: groups of GROUP consecutive columns of a row share a scale s and an offset z, and a weight is
`(q - 8)·s + z` with q in 0…15 (torch's packed int4 layout). The quantizer maps each group's minimum to q = 0 and
its maximum to q = 15 — GGUF's Q4_1 rule — so a Q4_1 file's weights, dequantized at conversion, come back as
the very same 4-bit codes and differ from the file only by the scales' rounding to the activations' dtype.
Int8Weight: one fp32 scale per row, symmetric (q in -127…127), as torch's int8 weight-only GEMM takes it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GROUP = 32                  # columns sharing a scale and offset: Q4_1's block, the finest torch's kernel takes
INNER_K_TILES = 1           # the packing's tile argument for the CPU kernel (it packs two codes a byte)


@dataclass
class Int4Weight:
    packed: torch.Tensor        # [N, K / 2] uint8, torch's CPU int4 layout
    scale_zeros: torch.Tensor   # [K / GROUP, N, 2]: each group's scale and offset, in the activations' dtype
    shape: torch.Size           # [N, K]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`: (q - 8)·s + z, as the kernel computes it (the kernel applied to the identity reads
        the codes back through their own layout)."""
        n, k = self.shape
        eye = torch.eye(k, dtype=self.scale_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scale_zeros).t() \
            .to(dtype).contiguous()

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
        """`fn` (a reordering of dim 0) applied to the rows: the groups run along a row, so reordering the
        dequantized rows and quantizing again gives back each row's own codes, scales and offsets."""
        return quantize_int4(fn(self.dequantize(torch.float32)), self.scale_zeros.dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] (in the scales' dtype) · weightᵀ → [T, N]."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.scale_zeros.dtype), self.packed, GROUP,
                                                          self.scale_zeros).to(x.dtype)


@dataclass
class Int8Weight:
    weight: torch.Tensor        # [N, K] int8
    scale: torch.Tensor         # [N] in the activations' dtype: a row's values are weight · scale

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.scale.float()[:, None]).to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(self.scale.dtype), self.weight, self.scale).to(x.dtype)


def quantize_int4(w: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """w [N, K] (K a multiple of GROUP, on the CPU) → 4-bit codes with a scale and an offset per group of GROUP
    columns (held in `dtype`, the activations'): min → 0, max → 15, as GGUF's Q4_1 quantizes."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 weights need a multiple of {GROUP} columns, got {k}")
    groups = w.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = torch.aminmax(groups, dim=-1)          # one pass (amin and amax apart take 5x longer at load)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = (groups - lo[..., None]).mul_(inv[..., None]).round_().clamp_(0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), INNER_K_TILES)
    zeros = lo + 8 * scale                                       # (q - 8)·s + z = q·s + lo
    scale_zeros = torch.stack([scale.t(), zeros.t()], -1).to(dtype).contiguous()   # [K/GROUP, N, 2]
    return Int4Weight(packed, scale_zeros, torch.Size((n, k)))


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """w [N, K] → int8 rows with one symmetric scale each (amax / 127; an all-zero row gets scale 1)."""
    wf = w.detach().float()
    amax = wf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(q, scale.to(dtype))
