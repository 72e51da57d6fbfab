"""The CPU op set's int4 GEMM (kernels/cpu_int4.py, csrc/cpu/int4_gemm.c): its layout holds torch's codes and
scales exactly, and its product matches the dequantized weights' on random data at many shapes, batch sizes and
thread counts; the op set adopts the projections it can run and leaves the others to torch."""
from __future__ import annotations

import pytest
import torch

from mii_async.kernels import cpu, cpu_build
from mii_async.kernels.cpu_int4 import NativeInt4Weight, from_int4, pack, packable
from mii_async.kernels.int_weight import Int4Weight, quantize_int4

SHAPES = [(64, 32), (128, 64), (192, 576), (960, 576), (576, 1536)]


def _native() -> bool:
    lib = cpu_build.load()
    return lib is not None and lib.int4_gemm_native() == 1


needs_native = pytest.mark.skipif(not _native(), reason="the int4 GEMM needs the CPU library built with "
                                  "AVX512-BF16 (this CPU or compiler has none, or the library is off)")


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_layout_holds_torchs_codes_and_scales(n, k):
    """Read from torch's packing, laid out anew and read back: the same dequantized weights as torch's kernel
    gives (its bf16 result), and the same codes and scales after a round trip through pack()."""
    g = torch.Generator().manual_seed(n + k)
    w4 = quantize_int4(torch.randn(n, k, generator=g), torch.bfloat16)
    native = from_int4(w4)
    assert native.shape == w4.shape and native.codes.dtype == torch.uint8
    assert torch.equal(native.dequantize(torch.float32).bfloat16(), w4.dequantize(torch.bfloat16))
    codes, sz = native.rows()
    again = pack(codes, sz)
    assert torch.equal(again.codes, native.codes) and torch.equal(again.scale_zeros, native.scale_zeros)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15


def test_map_rows_reorders_codes_with_their_scales():
    w4 = quantize_int4(torch.randn(192, 64), torch.bfloat16)
    order = torch.randperm(192)
    moved = from_int4(w4).map_rows(lambda t: t[order])
    assert isinstance(moved, NativeInt4Weight)
    assert torch.equal(moved.dequantize(torch.float32), from_int4(w4).dequantize(torch.float32)[order])


@needs_native
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 17])
def test_the_gemm_matches_the_dequantized_weights(n, k, m):
    """Against x · dequantized(W)ᵀ in fp32: no further from it than torch's own int4 kernel is (both round to
    bf16), every row of y written."""
    g = torch.Generator().manual_seed(1000 * m + n + k)
    w4 = quantize_int4(torch.randn(n, k, generator=g), torch.bfloat16)
    native = from_int4(w4)
    x = torch.randn(m, k, generator=g).bfloat16()
    want = x.float() @ native.dequantize(torch.float32).t()
    torch.set_num_threads(1)
    y = cpu.linear(x, native)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and torch.isfinite(y).all()
    err = (y.float() - want).norm() / want.norm()
    torch_err = (w4.linear(x).float() - want).norm() / want.norm()
    assert err <= max(1.5 * torch_err, 4e-3), (float(err), float(torch_err))
    assert ((y.float() - want).abs() <= 0.02 * want.abs().max() + 1e-3).all()


@needs_native
def test_threads_split_blocks_and_give_the_same_bits():
    """The 64-row blocks split over threads: each block computes alone, so any thread count gives the same y."""
    native = from_int4(quantize_int4(torch.randn(960, 576), torch.bfloat16))
    x = torch.randn(6, 576).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.linear(x, native)
        torch.set_num_threads(2)
        two = cpu.linear(x, native)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_native
def test_fp32_activations_and_a_bias():
    """x in fp32 is cast to bf16 as torch's int4 kernel casts it, and the result back; a bias is added."""
    native = from_int4(quantize_int4(torch.randn(128, 64), torch.bfloat16))
    x, bias = torch.randn(3, 64), torch.randn(128)
    y = cpu.linear(x, native, bias)
    assert y.dtype == torch.float32
    assert torch.equal(y, cpu.linear(x.bfloat16(), native).float() + bias)
    with pytest.raises(ValueError, match="64 columns"):
        cpu.linear(torch.randn(3, 32), native)


@needs_native
def test_the_op_set_adopts_what_it_can_run():
    """Blocks of 64 rows and bf16 scales: adopted; 32 rows, or fp32 scales (int4 with fp32 activations, which
    torch's kernel keeps exact), or a dense weight: left as they are."""
    assert isinstance(cpu.adopt_weight(quantize_int4(torch.randn(128, 64), torch.bfloat16)), NativeInt4Weight)
    for w in (quantize_int4(torch.randn(32, 64), torch.bfloat16), quantize_int4(torch.randn(128, 64), torch.float32)):
        assert isinstance(w, Int4Weight) and not packable(w) and cpu.adopt_weight(w) is w
    dense = torch.randn(128, 64)
    assert cpu.adopt_weight(dense) is dense


needs_int8 = pytest.mark.skipif(cpu_build.load() is None or cpu_build.load().int8_gemm_native() != 1,
                                reason="the int8 GEMM needs the CPU library built with AVX-512F")


@needs_int8
@pytest.mark.parametrize("n,k", [(4096, 64), (1000, 576), (49152, 576)])
@pytest.mark.parametrize("m", [1, 3, 6])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_int8_head_gemm_matches_the_dequantized_weights(n, k, m, dtype):
    """The int4 scheme's int8 head (one scale a row), natively: as near x · dequantized(W)ᵀ as torch's kernel, in
    the activations' dtype, whatever the head's threads (each row computes alone: the same bits)."""
    from mii_async.kernels.int_weight import quantize_int8

    g = torch.Generator().manual_seed(n + k + m)
    w8 = quantize_int8(torch.randn(n, k, generator=g), dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    want = x.float() @ w8.dequantize(torch.float32).t()
    outs = []
    try:
        for threads in (1, 2):
            cpu.set_head_threads(threads)
            outs.append(cpu.linear(x, w8))
    finally:
        cpu.set_head_threads(torch.get_num_threads())
    y = outs[0]
    assert y.dtype == dtype and y.shape == (m, n) and torch.equal(outs[0], outs[1])
    err = (y.float() - want).norm() / want.norm()
    torch_err = (w8.linear(x).float() - want).norm() / want.norm()
    assert err <= max(1.5 * torch_err, 1e-5), (float(err), float(torch_err))
    assert ((y.float() - want).abs() <= 0.01 * want.abs().max() + 1e-4).all()



@needs_native
def test_no_rows_give_no_rows():
    """A step that samples no row hands the head (and may hand a projection) x [0, K]: y [0, N], nothing read."""
    from mii_async.kernels.int_weight import quantize_int8

    native = from_int4(quantize_int4(torch.randn(128, 64), torch.bfloat16))
    assert cpu.linear(torch.empty(0, 64, dtype=torch.bfloat16), native).shape == (0, 128)
    w8 = quantize_int8(torch.randn(96, 64), torch.bfloat16)
    assert cpu.linear(torch.empty(0, 64, dtype=torch.bfloat16), w8).shape == (0, 96)
