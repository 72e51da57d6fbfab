"""FP8Weight: a linear weight in FP8 e4m3 with the fp32 scales that multiply it, and the torch definitions of
quantizing and dequantizing, which the reference ops, the loader and the CUDA ops' tests share.

A weight's value is `weight[n, k] · scale[n]` (per output channel) or `weight[n, k] · scale[n, k // BLOCK_K]`
(per row and block of BLOCK_K columns: a checkpoint's [128, 128] block scales with their rows repeated, so that
a fused projection is its parts' rows concatenated and a tensor-parallel rank's rows are a plain slice, at
4/128 bytes a weight). Block scales are held with strides (1, N) (a contiguous [ceil(K/BLOCK_K), N],
transposed), the layout torch._scaled_mm takes for 1x128 weight scales. Activations are quantized per token
(or per token and block of BLOCK_K columns beside block scales), dynamically, or with a checkpoint's static
scale: `quantize_activations`.

Wherever an op takes a weight [N, K] in the activations' dtype, it also takes an FP8Weight (kernels/reference.py
dequantizes it; kernels/fp8_linear.py runs it on the GPU). Indexing and concatenation go through uint8 views,
which every torch device implements for them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0                # the largest finite e4m3fn
INV_E4M3_MAX = 1.0 / E4M3_MAX   # scales are amax times this (fp32), as torch divides a CUDA tensor by a scalar
BLOCK_K = 128                   # columns a block scale covers
MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)    # an all-zero row's scale (any positive one gives zeros): no division by 0


@dataclass
class FP8Weight:
    weight: torch.Tensor                    # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor                     # fp32 [N] per output channel, or [N, ceil(K / BLOCK_K)] per row and block,
                                            # strides (1, N)
    input_scale: torch.Tensor | None = None     # fp32 [1]: a static activation scale (a checkpoint's); None: per
                                                # token, dynamic

    def __post_init__(self) -> None:
        n, k = self.weight.shape
        assert self.weight.dtype == E4M3, f"an FP8 weight is float8_e4m3fn, got {self.weight.dtype}"
        assert self.scale.dtype == torch.float32, f"FP8 scales are fp32, got {self.scale.dtype}"
        assert self.scale.shape in ((n,), (n, -(-k // BLOCK_K))), \
            f"scales {tuple(self.scale.shape)} fit neither per-channel [{n}] nor block [{n}, {-(-k // BLOCK_K)}]"
        if self.scale.dim() == 1:
            self.scale = self.scale.contiguous()
        elif self.scale.stride() != (1, n):
            self.scale = self.scale.t().contiguous().t()

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def blocked(self) -> bool:
        """Scales per row and block of BLOCK_K columns (else per row)."""
        return self.scale.dim() == 2

    @property
    def nbytes(self) -> int:
        extra = self.input_scale.numel() * 4 if self.input_scale is not None else 0
        return self.weight.numel() + self.scale.numel() * 4 + extra

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`: weight · scale in fp32, rounded once."""
        return dequantize(self.weight, self.scale).to(dtype)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> FP8Weight:
        """The weight with `fn` (a reordering or selection of dim 0) applied to its rows and their scales."""
        return FP8Weight(fn(self.weight.view(torch.uint8)).contiguous().view(E4M3), fn(self.scale), self.input_scale)


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] · scales ([N] or [N, ceil(K / BLOCK_K)]) → fp32 [N, K]."""
    w = weight.float()
    if scale.dim() == 1:
        return w * scale[:, None]
    return w * scale.repeat_interleave(BLOCK_K, dim=1)[:, :w.shape[1]]


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already divided by their scale → e4m3, saturated at ±448, rounded to nearest even."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def weight_scales(w: torch.Tensor) -> torch.Tensor:
    """[N, K] → fp32 [N]: each row's largest magnitude over 448."""
    return (w.float().abs().amax(dim=1) * INV_E4M3_MAX).clamp(min=MIN_SCALE)


def quantize_weight(w: torch.Tensor, scale: torch.Tensor | None = None) -> FP8Weight:
    """[N, K] in any float dtype → e4m3 with a scale per output channel, computed in fp32 on w's device:
    `scale` [N] when given (the whole rows' scales, of which w holds some columns), else weight_scales(w)."""
    wf = w.float()
    scale = weight_scales(wf) if scale is None else scale.to(device=wf.device, dtype=torch.float32)
    return FP8Weight(to_e4m3(wf / scale[:, None]).contiguous(), scale.contiguous())


def quantize_blocks(w: torch.Tensor, block: int = BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] → (e4m3 [N, K], fp32 scales [ceil(N/block), ceil(K/block)]): a checkpoint's block-wise layout
    (transformers' fp8 `weight_scale_inv`, compressed-tensors' block strategy)."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, block, kb, block)
    scale = (tiles.abs().amax(dim=(1, 3)) * INV_E4M3_MAX).clamp(min=MIN_SCALE)  # [nb, kb]
    q = to_e4m3(tiles / scale[:, None, :, None]).view(nb * block, kb * block)[:n, :k]
    return q.contiguous(), scale.contiguous()


def block_rows(scale: torch.Tensor, start: int, end: int, block: int = BLOCK_K) -> torch.Tensor:
    """Block scales [ceil(N/block), KB] → the scales of rows [start, end), one row each: [end - start, KB]."""
    rows = torch.arange(start, end, device=scale.device) // block
    return scale.index_select(0, rows)


def cat_rows(parts: Sequence[FP8Weight]) -> FP8Weight:
    """The parts' rows, in order: a fused projection (q|k|v, gate|up). Static activation scales, which the
    parts share one input of, become their largest."""
    if len(parts) == 1:
        return parts[0]
    statics = [p.input_scale for p in parts if p.input_scale is not None]
    assert len(statics) in (0, len(parts)), "a fused projection's parts must all have static input scales or none"
    weight = torch.cat([p.weight.view(torch.uint8) for p in parts], 0).view(E4M3)
    return FP8Weight(weight, torch.cat([p.scale for p in parts], 0),
                     torch.stack(statics).amax().reshape(1) if statics else None)


def quantize_activations(x: torch.Tensor, group: int | None = None,
                         static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] → (e4m3 [T, K], fp32 scales): per token [T] (`group` None), or per token and group of `group`
    columns [T, ceil(K / group)]; with `static_scale` ([1]) that scale for every token ([T]). A token's (or
    group's) largest magnitude maps to 448 (scale = amax · fp32(1/448)); x / scale is rounded to nearest even, as
    the CUDA kernel does it."""
    xf = x.float()
    t, k = xf.shape
    if static_scale is not None:
        scale = static_scale.float().reshape(1).expand(t).contiguous()
        return to_e4m3(xf / scale[:, None]).contiguous(), scale
    if group is None:
        scale = (xf.abs().amax(dim=1) * INV_E4M3_MAX).clamp(min=MIN_SCALE)    # [T]
        return to_e4m3(xf / scale[:, None]).contiguous(), scale
    g = -(-k // group)
    padded = torch.zeros(t, g * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = xf
    tiles = padded.view(t, g, group)
    scale = (tiles.abs().amax(dim=2) * INV_E4M3_MAX).clamp(min=MIN_SCALE)      # [T, G]
    q = to_e4m3(tiles / scale[:, :, None]).view(t, g * group)[:, :k]
    return q.contiguous(), scale.contiguous()
