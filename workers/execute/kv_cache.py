"""The KV pool: per layer a K and a V tensor of [num_blocks, block_size, Hkv, D]."""
from __future__ import annotations

import numpy as np
import torch

from ..model.loader import ModelSpec

ALIGN = 64                  # bytes: the CPU pool starts on a cache line


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * dtype.itemsize


def allocate(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer a zeroed K and V of [num_blocks, block_size, Hkv, D]. On the CPU the whole pool is one calloc'd
    buffer (numpy's zeros): the kernel hands it over as zero pages, touched only as blocks are written, where
    torch.zeros would write every byte at start (about 1 s for the default 0.5 GiB pool on a small machine)."""
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    if device.type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(spec.num_layers)]
    per = num_blocks * block_size * spec.num_kv_heads * spec.head_dim
    size = 2 * spec.num_layers * per * dtype.itemsize
    raw = torch.from_numpy(np.zeros(size + ALIGN, dtype=np.uint8))
    skip = -raw.data_ptr() % ALIGN                          # the vector units' cache-line alignment
    parts = raw[skip:skip + size].view(dtype).view(spec.num_layers, 2, *shape)
    return [(parts[i, 0], parts[i, 1]) for i in range(spec.num_layers)]
