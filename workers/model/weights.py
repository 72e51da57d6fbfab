"""Weights: one rank's view of a checkpoint while a model loads: tensors on the device in the model's dtype,
whole, or the rows or columns that this tensor-parallel rank holds, read alone from the source; and the linear
projections, which under a WeightQuant (workers/model/quantization.py) load as FP8 with their scales sliced
alike (quantized_loading.py)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from mii_async.kernels.fp8_weight import E4M3

from .quantized_loading import LinearWeight, Part, dequantized, read_linear
from .quantization import WeightQuant
from .shard_plan import ShardPlan


class WeightSource(Protocol):
    """Name → tensor: loader.WeightReader (safetensors files) and loader.TensorReader (tensors in memory)."""

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str, dim: int, start: int, end: int) -> torch.Tensor: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


class Weights:
    def __init__(self, source: WeightSource, dtype: torch.dtype, device: torch.device,
                 shard: ShardPlan | None, quant: WeightQuant | None = None,
                 adopt: Callable[[LinearWeight], LinearWeight] | None = None) -> None:
        self.source, self.dtype, self.device = source, dtype, device
        self.shard = shard              # this rank's heads, FFN and vocabulary rows; None: the whole model
        self.quant = quant              # how the linear projections load; None: in the model dtype
        self.adopt = adopt              # the op set's hand on a quantized projection (its own layout), if any

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor (replicated on every rank: norms, a bias added once)."""
        return self._put(name, self.source.get(name), None, None)

    def rows(self, name: str, span: tuple[int, int] | None, unit: int = 1) -> torch.Tensor:
        """Rows [start·unit, end·unit) of `span` (a column-parallel weight: `unit` rows a head), or the whole
        tensor when `span` is None (no tensor parallelism). Works on a bias (1-D) as on a matrix."""
        if span is None:
            return self.get(name)
        bounds = (span[0] * unit, span[1] * unit)
        return self._put(name, self.source.get_slice(name, 0, *bounds), 0, bounds)

    def columns(self, name: str, span: tuple[int, int] | None, unit: int = 1) -> torch.Tensor:
        """Columns [start·unit, end·unit) (a row-parallel weight), or the whole tensor when `span` is None."""
        if span is None:
            return self.get(name)
        bounds = (span[0] * unit, span[1] * unit)
        return self._put(name, self.source.get_slice(name, 1, *bounds), 1, bounds)

    def linear(self, parts: Sequence[Part]) -> LinearWeight:
        """A projection [N, K]: the rows of each part (name, span or None for all, rows per span unit)
        concatenated (q|k|v, gate|up); FP8 under `quant`."""
        if self.quant is not None:
            return self._adopted(read_linear(self, parts))
        tensors = [self.rows(name, span, unit) for name, span, unit in parts]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, 0)

    def linear_columns(self, name: str, span: tuple[int, int] | None, unit: int = 1) -> LinearWeight:
        """A row-parallel projection: columns [start·unit, end·unit) of `name` (all when `span` is None); FP8
        under `quant`."""
        if self.quant is not None:
            return self._adopted(read_linear(self, [(name, span, unit)], dim=1))
        return self.columns(name, span, unit)

    def _adopted(self, weight: LinearWeight) -> LinearWeight:
        return self.adopt(weight) if self.adopt is not None else weight

    def _put(self, name: str, t: torch.Tensor, dim: int | None, bounds: tuple[int, int] | None) -> torch.Tensor:
        if t.dtype == E4M3:             # an FP8 checkpoint's tensor that the model holds in its dtype
            return dequantized(self, name, t, dim, bounds)
        return t.to(device=self.device, dtype=self.dtype)
