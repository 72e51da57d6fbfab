"""A decode call's own choice of kernel, block width or grid order (`kernel=`, `warps=`, `grid=`, which override
its KernelConfig) is checked by name before any GPU work, so these run on the CPU."""
from __future__ import annotations

import pytest
import torch

from mii_async.kernels import cuda as K
from mii_async.kernels.config import DECODE_KERNELS, KernelConfig


def _decode(**choice):
    """A one-sequence decode call on CPU tensors: a bad choice is refused before any GPU work."""
    q = torch.zeros(1, 4, 128)
    cache = torch.zeros(2, 16, 1, 128)
    return K.paged_attention_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.int64),
                                    torch.ones(1, dtype=torch.int64), 1, 1.0, **choice)


def test_an_unknown_kernel_argument_is_refused_by_name():
    with pytest.raises(ValueError, match="kernel must be one of mma, stream, split, got 'fast'"):
        _decode(kernel="fast")


def test_a_bad_block_width_is_refused_by_name_whatever_the_kernel_and_config():
    for kernel in DECODE_KERNELS:
        with pytest.raises(ValueError, match="warps must be 2 or 4, got 3"):
            _decode(kernel=kernel, warps=3)
        with pytest.raises(ValueError, match="warps must be 2 or 4, got 3"):
            _decode(warps=3, config=KernelConfig(decode_kernel=kernel, mma_narrow_from=0))


def test_an_unknown_grid_order_is_refused_by_name_whatever_the_config():
    for grid in ("kv_heads", "sequences"):
        with pytest.raises(ValueError, match="grid must be one of kv_heads, sequences, got 'heads'"):
            _decode(grid="heads", config=KernelConfig(decode_grid=grid))

