"""The decode kernel is chosen by name (MII_ASYNC_DECODE or `kernel=`); a wrong name is an error that says
which setting it was, before any GPU work (so this runs on the CPU)."""
import os
import subprocess
import sys

import pytest
import torch

from mii_async.kernels import cuda as K
from mii_async.kernels import decode_attention as DA


def _decode(**choice):
    """A one-sequence decode call on CPU tensors: a bad choice is refused before any GPU work."""
    q = torch.zeros(1, 4, 128)
    cache = torch.zeros(2, 16, 1, 128)
    return K.paged_attention_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.int64),
                                    torch.ones(1, dtype=torch.int64), 1, 1.0, **choice)


def _import_with(name: str, value: str) -> subprocess.CompletedProcess:
    """Imports the CUDA kernels' module in a fresh interpreter with environment variable `name` set."""
    return subprocess.run([sys.executable, "-c", "import mii_async.kernels.cuda"], capture_output=True, text=True,
                          env=dict(os.environ, **{name: value}))


def test_an_unknown_kernel_argument_is_refused_by_name():
    with pytest.raises(ValueError, match="kernel must be one of mma, stream, split"):
        _decode(kernel="fast")


def test_a_bad_block_width_is_refused_by_name_whatever_the_kernel():
    for kernel in DA.DECODE_KERNELS:
        with pytest.raises(ValueError, match="warps must be 2 or 4, got 3"):
            _decode(kernel=kernel, warps=3)


def test_an_unknown_environment_choice_is_refused_by_name():
    r = _import_with("MII_ASYNC_DECODE", "fast")
    assert r.returncode != 0 and "MII_ASYNC_DECODE must be one of mma, stream, split, got 'fast'" in r.stderr


def test_the_default_is_the_tensor_core_kernel():
    assert DA.DECODE_KERNEL in DA.DECODE_KERNELS
    assert os.environ.get("MII_ASYNC_DECODE") or DA.DECODE_KERNEL == "mma"


def test_an_unknown_grid_order_is_refused_by_name():
    with pytest.raises(ValueError, match="grid must be one of kv_heads, sequences, got 'heads'"):
        _decode(grid="heads")
    r = _import_with("MII_ASYNC_DECODE_GRID", "heads")
    assert r.returncode != 0 and "MII_ASYNC_DECODE_GRID must be one of kv_heads, sequences, got 'heads'" in r.stderr


def test_the_default_grid_puts_a_sequences_kv_heads_side_by_side():
    assert os.environ.get("MII_ASYNC_DECODE_GRID") or DA.DECODE_GRID == "kv_heads"
