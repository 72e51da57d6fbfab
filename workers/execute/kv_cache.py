"""The KV pool: per layer a K and a V tensor of [num_blocks, block_size, Hkv, D]."""
from __future__ import annotations

import torch

from ..model.loader import ModelSpec


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * dtype.itemsize


def allocate(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(spec.num_layers)]
