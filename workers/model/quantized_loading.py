"""Reading a linear weight under a quantization scheme. FP8 (kernels/fp8_weight.py's FP8Weight): from an FP8
checkpoint, the e4m3 rows or columns this rank holds with their scales sliced alike; from a float checkpoint
under `quantization="fp8"`, each part quantized per output channel on the device it loads to as it is read
(never the whole model in the model dtype first). int4 (kernels/int_weight.py, the CPU's): a projection's parts
read in the model dtype, concatenated and quantized in groups of 32 columns.

A checkpoint's scales sit beside the weight as `<linear>.<suffix>` (WeightQuant.scale_suffix) in one of three
shapes: per output channel [N, 1] or [N], per tensor [1] or [] (repeated per channel: a fused projection's
parts keep their own), per [128, 128] block [ceil(N/128), ceil(K/128)] (repeated per row: kernels/fp8_weight.py).
A static activation scale is `<linear>.input_scale`. Columns of block scales are taken a whole block at a time:
a tensor-parallel split inside a block is refused, naming tensor_parallel.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Union

import torch

from mii_async.errors import InvalidParameterError, UnsupportedModelError
from mii_async.kernels.cpu_int4 import NativeInt4Weight
from mii_async.kernels.fp8_weight import (BLOCK_K, E4M3, FP8Weight, block_rows, cat_rows, quantize_weight,
                                          weight_scales)
from mii_async.kernels.int_weight import GROUP, Int4Weight, quantize_int4

if TYPE_CHECKING:
    from .weights import Weights

# [N, K] in the model dtype, FP8 or int4 with scales (torch's packing, or the CPU op set's: kernels/cpu_int4.py)
LinearWeight = Union[torch.Tensor, FP8Weight, Int4Weight, NativeInt4Weight]
Part = tuple[str, Union[tuple[int, int], None], int]  # a checkpoint tensor, its span (None: whole), rows a unit
SCALE_SLAB = 4096                                     # rows read at once to find a row-parallel weight's scales


def read_linear(w: Weights, parts: Sequence[Part], dim: int = 0) -> LinearWeight:
    """The rows (dim 0) or columns (dim 1) of each part, rows concatenated: one projection in FP8 under
    w.quant (checkpoint tensors stored in a float dtype stay in the model dtype: an ignored module)."""
    assert w.quant is not None, "read_linear is the quantized path"
    if w.quant.integer:
        return _read_int4(w, parts, dim)
    fp8: list[FP8Weight] = []
    dense: list[torch.Tensor] = []
    for name, span, unit in parts:
        bounds = None if span is None else (span[0] * unit, span[1] * unit)
        raw = _read(w, name, dim, bounds)
        if raw.dtype == E4M3:
            fp8.append(_with_scales(w, name, raw, dim, bounds))
        elif w.quant.at_load:
            fp8.append(quantize_weight(raw.to(w.device), _row_scales(w, name) if dim == 1 and bounds else None))
        else:
            dense.append(raw.to(device=w.device, dtype=w.dtype))
    if fp8 and dense:
        raise UnsupportedModelError(f"{', '.join(p[0] for p in parts)}: one projection's parts are partly FP8 and "
                                    "partly not; they are loaded as one weight")
    return cat_rows(fp8) if fp8 else (dense[0] if len(dense) == 1 else torch.cat(dense, 0))


def map_rows(weight: LinearWeight, fn: Callable[[torch.Tensor], torch.Tensor]) -> LinearWeight:
    """`fn` (a reordering of dim 0) applied to a projection's rows, and to their scales when it is quantized."""
    return weight.map_rows(fn) if isinstance(weight, (FP8Weight, Int4Weight, NativeInt4Weight)) else fn(weight)


def _read_int4(w: Weights, parts: Sequence[Part], dim: int) -> Int4Weight:
    """The parts read in the model dtype, rows concatenated, quantized to int4 (groups of GROUP columns run
    along a row, so a row-parallel rank's columns must start and end on a group's edge)."""
    dense = []
    for name, span, unit in parts:
        bounds = None if span is None else (span[0] * unit, span[1] * unit)
        if dim == 1 and bounds is not None and (bounds[0] % GROUP or bounds[1] % GROUP):
            raise InvalidParameterError("tensor_parallel", f"it splits {name}'s columns at {list(bounds)}, inside a "
                                        f"{GROUP}-column group of its int4 weights")
        raw = _read(w, name, dim, bounds)
        if raw.dtype == E4M3:
            raise UnsupportedModelError(f"weight {name!r} is float8: int4 quantizes float checkpoints")
        dense.append(raw.to(w.device))
    whole = dense[0] if len(dense) == 1 else torch.cat(dense, 0)
    if whole.shape[1] % GROUP:
        raise UnsupportedModelError(f"{parts[0][0]} has {whole.shape[1]} columns; int4 weights need a multiple of "
                                    f"{GROUP}")
    return quantize_int4(whole, w.dtype)


def dequantized(w: Weights, name: str, raw: torch.Tensor, dim: int | None,
                bounds: tuple[int, int] | None) -> torch.Tensor:
    """An e4m3 checkpoint tensor that the model holds in its dtype (an expert, an embedding), with its scales."""
    return _with_scales(w, name, raw.to(w.device), dim, bounds).dequantize(w.dtype)


def _row_scales(w: Weights, name: str) -> torch.Tensor:
    """Per-channel scales of the whole rows of `name`, read a slab of rows at a time: a row-parallel rank
    quantizes its columns with the scales one rank would, so that every tensor_parallel runs the same weights."""
    rows = w.source.shape(name)[0]
    return torch.cat([weight_scales(w.source.get_slice(name, 0, a, min(rows, a + SCALE_SLAB)).to(w.device))
                      for a in range(0, rows, SCALE_SLAB)])


def _read(w: Weights, name: str, dim: int, bounds: tuple[int, int] | None) -> torch.Tensor:
    return w.source.get(name) if bounds is None else w.source.get_slice(name, dim, *bounds)


def _with_scales(w: Weights, name: str, raw: torch.Tensor, dim: int | None,
                 bounds: tuple[int, int] | None) -> FP8Weight:
    """e4m3 rows or columns `bounds` of `name` (dim 0 or 1; None: whole) with its scales, on w's device."""
    quant = w.quant
    if quant is None or quant.at_load:
        raise UnsupportedModelError(f"weight {name!r} is stored in float8 but config.json has no quantization_config "
                                    "that gives its scales")
    assert name.endswith("weight"), f"an FP8 tensor {name!r} that is not a weight"
    base = name[:-len("weight")]
    scale_name = base + quant.scale_suffix
    if scale_name not in w.source:
        raise UnsupportedModelError(f"weight {name!r} is float8 but its scales {scale_name!r} are missing")
    rows = raw.shape[0]
    if quant.scales == "block":
        blocks = w.source.get(scale_name).float()
        if dim == 0 and bounds is not None:
            scale = block_rows(blocks, *bounds)
        else:
            scale = block_rows(blocks, 0, rows)
            if dim == 1 and bounds is not None:
                scale = scale[:, _block_columns(name, bounds, w.source.shape(name)[1])]
    else:
        whole = w.source.get(scale_name).float().reshape(-1)
        if quant.scales == "tensor" or whole.numel() == 1:
            scale = whole.expand(rows)
        elif dim == 0 and bounds is not None:
            scale = w.source.get_slice(scale_name, 0, *bounds).float().reshape(-1)
        else:
            scale = whole
    if scale.shape[0] != rows:
        raise UnsupportedModelError(f"{scale_name!r} holds {tuple(scale.shape)} scales for the {rows} rows of "
                                    f"{name!r} ({quant.method}, {quant.scales} scales)")
    input_scale = None
    if quant.static_activations:
        if base + "input_scale" not in w.source:
            raise UnsupportedModelError(f"{base}input_scale is missing: quantization_config gives static "
                                        "activation scales")
        input_scale = w.source.get(base + "input_scale").float().reshape(-1)[:1].to(w.device)
    return FP8Weight(raw.to(w.device).contiguous(), scale.contiguous().to(w.device), input_scale)


def _block_columns(name: str, bounds: tuple[int, int], k: int) -> slice:
    """The block-scale columns of weight columns [start, end): whole blocks only."""
    start, end = bounds
    if start % BLOCK_K or (end % BLOCK_K and end != k):
        raise InvalidParameterError("tensor_parallel", f"it splits {name}'s columns at [{start}, {end}), inside a "
                                    f"{BLOCK_K}-column block of its FP8 scales; choose a degree that splits them "
                                    f"at multiples of {BLOCK_K}")
    return slice(start // BLOCK_K, -(-end // BLOCK_K))
