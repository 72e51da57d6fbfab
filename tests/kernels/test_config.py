"""KernelConfig: its defaults are the kernels the engine runs, a bad choice is refused naming its field (or, from
the environment, its variable), and importing the kernels reads no environment variable."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from mii_async.kernels.config import DECODE_KERNELS, DEFAULT, GRID_ORDERS, KernelConfig


def test_the_defaults_are_tensor_cores_kv_heads_first_four_warps_and_pdl():
    c = KernelConfig()
    assert (c.decode_kernel, c.decode_grid, c.mma_narrow_from, c.pdl) == ("mma", "kv_heads", None, True)
    assert DEFAULT == c


@pytest.mark.parametrize("field,value,message", [
    ("decode_kernel", "fast", "decode_kernel must be one of mma, stream, split, got 'fast'"),
    ("decode_grid", "heads", "decode_grid must be one of kv_heads, sequences, got 'heads'"),
    ("mma_narrow_from", -1, "mma_narrow_from must be None or an int >= 0, got -1"),
    ("mma_narrow_from", True, "mma_narrow_from must be None or an int >= 0, got True"),
    ("mma_narrow_from", 2.5, "mma_narrow_from must be None or an int >= 0, got 2.5"),
    ("pdl", "0", "pdl must be true or false, got '0'"),
    ("gemv_prefetch", -16, "gemv_prefetch must be an int >= 0 (bytes), got -16"),
    ("gemv_prefetch", 1.5, "gemv_prefetch must be an int >= 0 (bytes), got 1.5"),
    ("prefill_attention", "fa3", "prefill_attention must be one of flash, cudnn, got 'fa3'"),
])
def test_a_bad_value_is_refused_naming_its_field(field, value, message):
    with pytest.raises(ValueError) as e:
        KernelConfig(**{field: value})
    assert str(e.value) == message


def test_every_named_choice_is_taken():
    for kernel in DECODE_KERNELS:
        for grid in GRID_ORDERS:
            c = KernelConfig(decode_kernel=kernel, decode_grid=grid, mma_narrow_from=0, pdl=False)
            assert (c.decode_kernel, c.decode_grid, c.mma_narrow_from, c.pdl) == (kernel, grid, 0, False)


def test_a_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.decode_grid = "sequences"           # type: ignore[misc]


def test_the_mma_width_narrows_from_the_threshold_on():
    assert [KernelConfig().mma_warps(p) for p in (1, 256, 10**6)] == [4, 4, 4]
    assert [KernelConfig(mma_narrow_from=0).mma_warps(p) for p in (1, 256)] == [2, 2]
    assert [KernelConfig(mma_narrow_from=256).mma_warps(p) for p in (255, 256, 257)] == [4, 2, 2]


def test_the_environment_names_a_config():
    assert KernelConfig.from_env({}) == KernelConfig()
    env = {"MII_ASYNC_DECODE": "stream", "MII_ASYNC_DECODE_GRID": "sequences", "MII_ASYNC_PDL": "0"}
    assert KernelConfig.from_env(env) == KernelConfig(decode_kernel="stream", decode_grid="sequences", pdl=False)
    assert KernelConfig.from_env({"MII_ASYNC_PDL": "1"}).pdl is True
    assert KernelConfig.from_env({"MII_ASYNC_GEMV_PREFETCH": "0"}).gemv_prefetch == 0
    assert KernelConfig.from_env({"MII_ASYNC_PREFILL": "cudnn"}).prefill_attention == "cudnn"


@pytest.mark.parametrize("name,value,message", [
    ("MII_ASYNC_DECODE", "fast", "MII_ASYNC_DECODE must be one of mma, stream, split, got 'fast'"),
    ("MII_ASYNC_DECODE_GRID", "heads", "MII_ASYNC_DECODE_GRID must be one of kv_heads, sequences, got 'heads'"),
    ("MII_ASYNC_GEMV_PREFETCH", "64k", "MII_ASYNC_GEMV_PREFETCH must be a number of bytes >= 0, got '64k'"),
    ("MII_ASYNC_PREFILL", "fa3", "MII_ASYNC_PREFILL must be one of flash, cudnn, got 'fa3'"),
])
def test_a_bad_environment_value_is_refused_naming_its_variable(name, value, message):
    with pytest.raises(ValueError) as e:
        KernelConfig.from_env({name: value})
    assert str(e.value) == message


def test_importing_the_kernels_reads_no_environment():
    """With every variable set to a value from_env refuses, the kernels and their op sets still import and
    build: only an entry point that asks (`KernelConfig.from_env`) reads them."""
    env = dict(os.environ, MII_ASYNC_DECODE="fast", MII_ASYNC_DECODE_GRID="heads", MII_ASYNC_PDL="0")
    code = ("import mii_async.kernels.cuda, mii_async.kernels.decode_attention, mii_async.kernels.launch; "
            "from mii_async.kernels import get_ops; print(get_ops('cuda').config)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == repr(KernelConfig())
