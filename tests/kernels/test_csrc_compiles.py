"""Every CUDA source compiles with `nvcc -arch=sm_90` (CI has nvcc and no GPU; MII_ASYNC_REQUIRE_NVCC=1 there)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).parents[2] / "kernels" / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for p in ("/usr/local/cuda/bin/nvcc", "/opt/cuda/bin/nvcc"):
        if os.access(p, os.X_OK):
            return p
    return None


# The decode kernels are also built with their grid's other order (kernels/decode_attention.py, grid="sequences"),
# and those that read or write an FP8 KV cache with MII_KV_FP8 (in both orders).
FP8_KV = ("rotary_kv", "paged_attention_decode", "paged_attention_mma")
VARIANTS = ([(s, ()) for s in SOURCES]
            + [(s, ("MII_SEQ_MAJOR_GRID",)) for s in SOURCES if s.stem.startswith("paged_attention_")]
            + [(s, ("MII_KV_FP8",)) for s in SOURCES if s.stem in FP8_KV]
            + [(s, ("MII_KV_FP8", "MII_SEQ_MAJOR_GRID")) for s in SOURCES
               if s.stem in FP8_KV and s.stem.startswith("paged_attention_")])


@pytest.mark.parametrize("source,defines", VARIANTS,
                         ids=[s.name + "".join(f"-D{d}" for d in defs) for s, defs in VARIANTS])
def test_compiles_for_sm90(source, defines, tmp_path):
    """The kernel source compiles for Hopper (sm_90) with nvcc."""
    nvcc = _nvcc()
    if nvcc is None:
        if os.environ.get("MII_ASYNC_REQUIRE_NVCC") == "1":
            pytest.fail("nvcc is required here (MII_ASYNC_REQUIRE_NVCC=1) but was not found")
        pytest.skip("nvcc not found")
    out = subprocess.run([nvcc, "-arch=sm_90", "--std=c++17", f"-I{CSRC}", *(f"-D{d}" for d in defines), "-c",
                          str(source), "-o", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "k.o").stat().st_size > 0


def test_there_are_kernels():
    """The kernel folder holds the sources the cuda backend loads."""
    names = {s.stem for s in SOURCES}
    assert {"norms", "activation", "rotary_kv", "paged_attention_decode"} <= names
