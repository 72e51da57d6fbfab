"""The FP8 GEMV compiles with `nvcc -arch=sm_90` in every variant the host launches (FP8_M rows 1 … 4, per-channel
and block scales; test_csrc_compiles.py builds each source's default), as kernels/fp8_linear.py defines them."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .test_csrc_compiles import CSRC, _nvcc

VARIANTS = [(m, block) for m in range(1, 5) for block in (0, 1)]


@pytest.mark.parametrize("m,block", VARIANTS, ids=[f"M{m}-{'block' if b else 'channel'}" for m, b in VARIANTS])
def test_gemv_fp8_variant_compiles_for_sm90(m, block, tmp_path):
    """gemv_fp8.cu with FP8_M=m and FP8_BLOCK=block compiles for Hopper, without spilling registers."""
    from mii_async.kernels import fp8_linear

    assert m <= fp8_linear.FP8_GEMV_MAX_M
    nvcc = _nvcc()
    if nvcc is None:
        if os.environ.get("MII_ASYNC_REQUIRE_NVCC") == "1":
            pytest.fail("nvcc is required here (MII_ASYNC_REQUIRE_NVCC=1) but was not found")
        pytest.skip("nvcc not found")
    out = subprocess.run([nvcc, "-arch=sm_90", "--std=c++17", f"-I{CSRC}", f"-DFP8_M={m}", f"-DFP8_BLOCK={block}",
                          "-Xptxas", "-v", "-c", str(Path(CSRC) / "gemv_fp8.cu"), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "bytes spill stores" in out.stderr and " 0 bytes spill stores" in out.stderr
    assert all(" 0 bytes spill stores" in line for line in out.stderr.splitlines() if "spill stores" in line)
