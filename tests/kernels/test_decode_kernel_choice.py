"""The decode kernel is chosen by name (MII_ASYNC_DECODE or `kernel=`); a wrong name is an error that says
which setting it was, before any GPU work (so this runs on the CPU)."""
import os
import subprocess
import sys

import pytest
import torch

from mii_async.kernels import cuda as K
from mii_async.kernels import decode_attention as DA


def test_an_unknown_kernel_argument_is_refused_by_name():
    q = torch.zeros(1, 4, 128)
    cache = torch.zeros(2, 16, 1, 128)
    with pytest.raises(ValueError, match="kernel must be one of mma, stream, split"):
        K.paged_attention_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.int64),
                                 torch.ones(1, dtype=torch.int64), 1, 1.0, kernel="fast")


def test_a_bad_block_width_is_refused_by_name_whatever_the_kernel():
    q = torch.zeros(1, 4, 128)
    cache = torch.zeros(2, 16, 1, 128)
    for kernel in DA.DECODE_KERNELS:
        with pytest.raises(ValueError, match="warps must be 2 or 4, got 3"):
            K.paged_attention_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.int64),
                                     torch.ones(1, dtype=torch.int64), 1, 1.0, kernel=kernel, warps=3)


def test_an_unknown_environment_choice_is_refused_by_name():
    env = dict(os.environ, MII_ASYNC_DECODE="fast")
    r = subprocess.run([sys.executable, "-c", "import mii_async.kernels.cuda"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "MII_ASYNC_DECODE must be one of mma, stream, split, got 'fast'" in r.stderr


def test_the_default_is_the_tensor_core_kernel():
    assert DA.DECODE_KERNEL in DA.DECODE_KERNELS
    assert os.environ.get("MII_ASYNC_DECODE") or DA.DECODE_KERNEL == "mma"


def test_an_unknown_grid_order_is_refused_by_name():
    q = torch.zeros(1, 4, 128)
    cache = torch.zeros(2, 16, 1, 128)
    with pytest.raises(ValueError, match="grid must be one of kv_heads, sequences, got 'heads'"):
        K.paged_attention_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.int64),
                                 torch.ones(1, dtype=torch.int64), 1, 1.0, grid="heads")
    env = dict(os.environ, MII_ASYNC_DECODE_GRID="heads")
    r = subprocess.run([sys.executable, "-c", "import mii_async.kernels.cuda"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "MII_ASYNC_DECODE_GRID must be one of kv_heads, sequences, got 'heads'" in r.stderr


def test_the_default_grid_puts_a_sequences_kv_heads_side_by_side():
    assert os.environ.get("MII_ASYNC_DECODE_GRID") or DA.DECODE_GRID == "kv_heads"
