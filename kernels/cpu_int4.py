"""NativeInt4Weight: an int4 projection in the CPU op set's own layout, multiplied by csrc/cpu/int4_gemm.c.

The same 4-bit codes, scales and offsets as the Int4Weight it is made from (kernels/int_weight.py: the numbers
do not change), laid out for AVX512-BF16's pairwise dot product: rows in blocks of 64, each pair of columns one
64-byte line (the C file says how). On the default model's shapes it runs 2-3x faster than torch's int4 kernel
at every batch size, one thread or several, with the same error against the dequantized weights; it replaces
torch's packing rather than sitting beside it, so the weights' bytes stay what they were.

The op set (kernels/cpu.py) adopts each int4 projection as it loads where the library has the instructions
(`int4_gemm_native()`) and the rows come in whole blocks of 64; anywhere else the Int4Weight stays, run by torch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .int_weight import GROUP, Int4Weight

BLOCK = 64                  # rows a block of the layout holds (int4_gemm.c's BLOCK)


@dataclass
class NativeInt4Weight:
    codes: torch.Tensor         # [N / BLOCK, K / 2, 64] uint8, int4_gemm.c's layout
    scale_zeros: torch.Tensor   # [N / BLOCK, K / GROUP, 2, BLOCK] bf16: each group's scales, then its offsets
    shape: torch.Size           # [N, K]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes [N, K] (0…15) and the (scale, offset) pairs [N, K / GROUP, 2], row by row."""
        n, k = self.shape
        t = self.codes.view(n // BLOCK, k // 2, 4, 2, 4, 2)              # block, pair, l, h, i, e
        planes = torch.stack([t & 15, t >> 4], -1)                       # … nibble
        codes = planes.permute(0, 6, 3, 2, 4, 1, 5).reshape(n, k)        # block, nibble, h, l, i | pair, e
        sz = self.scale_zeros.permute(0, 3, 1, 2).reshape(n, k // GROUP, 2)
        return codes, sz

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`: (q - 8)·s + z, in fp32 then rounded."""
        codes, sz = self.rows()
        n, k = self.shape
        s, z = sz[..., 0].float(), sz[..., 1].float()
        w = (codes.float().view(n, k // GROUP, GROUP) - 8) * s[..., None] + z[..., None]
        return w.view(n, k).to(dtype)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> NativeInt4Weight:
        """`fn` (a reordering of dim 0) applied to the rows' codes and their scales alike."""
        codes, sz = self.rows()
        return pack(fn(codes), fn(sz))


def packable(w: Int4Weight) -> bool:
    return w.shape[0] % BLOCK == 0 and w.packed.dtype == torch.uint8 and w.scale_zeros.dtype == torch.bfloat16


def from_int4(w: Int4Weight) -> NativeInt4Weight:
    """The Int4Weight's codes read from torch's CPU packing ([N / 64][K][32 bytes]: byte j of a column holds row
    j of the block in its low nibble, row 32 + j in its high one; tests/kernels/test_cpu_int4.py holds this
    against torch's own dequantization) and laid out anew."""
    n, k = w.shape
    p = w.packed.view(n // BLOCK, k, BLOCK // 2)
    codes = torch.cat([p & 15, p >> 4], -1).permute(0, 2, 1).reshape(n, k)
    return pack(codes, w.scale_zeros.permute(1, 0, 2))


def pack(codes: torch.Tensor, sz: torch.Tensor) -> NativeInt4Weight:
    """codes [N, K] (0…15), sz [N, K / GROUP, 2] bf16 → the layout (int4_gemm.c's header)."""
    n, k = codes.shape
    t = codes.to(torch.uint8).reshape(n // BLOCK, 2, 2, 4, 4, k // 2, 2)   # block, nibble, h, l, i, pair, e
    t = t.permute(0, 5, 3, 2, 4, 6, 1)                                    # block, pair, l, h, i, e, nibble
    lines = (t[..., 0] | (t[..., 1] << 4)).reshape(n // BLOCK, k // 2, 64).contiguous()
    scales = sz.to(torch.bfloat16).reshape(n // BLOCK, BLOCK, k // GROUP, 2).permute(0, 2, 3, 1).contiguous()
    return NativeInt4Weight(lines, scales, torch.Size((n, k)))

