"""Weights: one rank's view of a checkpoint while a model loads: tensors on the device in the model's dtype,
whole, or the rows or columns that this tensor-parallel rank holds, read alone from the source."""
from __future__ import annotations

from typing import Protocol

import torch

from .shard_plan import ShardPlan


class WeightSource(Protocol):
    """Name → tensor: loader.WeightReader (safetensors files) and loader.TensorReader (tensors in memory)."""

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str, dim: int, start: int, end: int) -> torch.Tensor: ...


class Weights:
    def __init__(self, source: WeightSource, dtype: torch.dtype, device: torch.device,
                 shard: ShardPlan | None) -> None:
        self.source, self.dtype, self.device = source, dtype, device
        self.shard = shard              # this rank's heads, FFN and vocabulary rows; None: the whole model

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor (replicated on every rank: norms, a bias added once)."""
        return self._put(self.source.get(name))

    def rows(self, name: str, span: tuple[int, int] | None, unit: int = 1) -> torch.Tensor:
        """Rows [start·unit, end·unit) of `span` (a column-parallel weight: `unit` rows a head), or the whole
        tensor when `span` is None (no tensor parallelism). Works on a bias (1-D) as on a matrix."""
        if span is None:
            return self.get(name)
        return self._put(self.source.get_slice(name, 0, span[0] * unit, span[1] * unit))

    def columns(self, name: str, span: tuple[int, int] | None, unit: int = 1) -> torch.Tensor:
        """Columns [start·unit, end·unit) (a row-parallel weight), or the whole tensor when `span` is None."""
        if span is None:
            return self.get(name)
        return self._put(self.source.get_slice(name, 1, span[0] * unit, span[1] * unit))

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype)
