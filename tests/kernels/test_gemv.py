"""gemv.cu (the projections of a few rows, the norm before them as a prologue, SiLU-and-mul after gate|up as an
epilogue) against the torch reference in fp32, on fresh random data with poisoned outputs; and the shapes that
must fall back to cuBLAS."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("cupy")

from mii_async.kernels import cuda as K  # noqa: E402
from mii_async.kernels import get_ops  # noqa: E402
from mii_async.kernels import reference as R  # noqa: E402
from mii_async.kernels.config import KernelConfig  # noqa: E402

from .test_cuda_kernels import TOL, poison, rel  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (M, N, K): the 8B shape's projections, TP shards, one row, widths that are not whole 256-element groups or
# not 16-byte chunks (cuBLAS then), and M past GEMV_MAX_M (cuBLAS).
SHAPES = [(1, 6144, 4096), (2, 4096, 4096), (3, 28672, 4096), (4, 4096, 14336), (1, 4096, 7168), (1, 37, 2056),
          (4, 1, 64), (1, 257, 100), (5, 512, 4096), (1, 128256, 576)]


def bound(dtype: torch.dtype, in_dtype: torch.Tensor, ref: torch.Tensor) -> float:
    """The error allowed against the fp32 reference `ref` for an op that rounds between its steps (the norm's
    output before the projection, gate and up before SiLU-and-mul): TOL, or a quarter more than the reference
    op's own error when it runs in `dtype` (`in_dtype`), whichever is larger. Few outputs (one column, or 64)
    with cancelling sums can put the reference itself past TOL: that is the dtype's rounding, not the
    kernel's, and the kernel is also held to the reference's roundings at TOL / 2 below."""
    return max(TOL[dtype], 1.25 * rel(in_dtype, ref))


def uses_gemv(dtype: torch.dtype, m: int, k: int) -> bool:
    return dtype != torch.float32 and m <= K.GEMV_MAX_M and k % 8 == 0


def data(m: int, n: int, k: int, dtype: torch.dtype, stride: int = 0):
    x = torch.randn(m, k + stride, device="cuda").to(dtype)[:, :k]
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_linear(dtype, m, n, k):
    x, w = data(m, n, k, dtype, stride=8)                           # strided input rows
    bias = torch.randn(n, device="cuda").to(dtype)
    assert K._gemv_ok(x, w, k, bias) == uses_gemv(dtype, m, k)
    for b in (None, bias):
        poison()
        out = K.linear(x, w, b)
        assert rel(out, R.linear(x.float(), w.float(), None if b is None else b.float())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_add_rms_norm_linear(dtype, m, n, k):
    """With and without a residual and a bias, in the dtype and as fp32 (logits); the summed residual too; and
    the norm rounded as the reference rounds it."""
    x, w = data(m, n, k, dtype)
    x = x.contiguous()
    res = torch.randn(m, k, device="cuda").to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    assert K._gemv_ok(x, w, k, bias, norm_w, res) == uses_gemv(dtype, m, k)
    f = lambda t: None if t is None else t.float()  # noqa: E731
    for r, b, out_dtype in ((None, None, None), (res, None, torch.float32), (res, bias, None)):
        poison()
        y, new_res = K.add_rms_norm_linear(x, r, norm_w, 1e-5, w, b, out_dtype=out_dtype)
        ref_y, ref_res = R.add_rms_norm_linear(x.float(), f(r), norm_w.float(), 1e-5, w.float(), f(b))
        in_dtype = R.add_rms_norm_linear(x, r, norm_w, 1e-5, w, b)[0]
        assert y.dtype == (out_dtype or dtype) and y.shape == (m, n)
        assert rel(y, ref_y) < bound(dtype, in_dtype, ref_y) and rel(new_res, ref_res) < TOL[dtype]
        if r is None:
            assert new_res is x
        # The norm rounded as the reference rounds it in this dtype, projected in fp32: only y's own rounding
        # is left between the two (not a cuBLAS fp16 GEMM's reduced-precision sums).
        normed = R.rms_norm(x, norm_w, 1e-5) if r is None else R.fused_add_rms_norm(x, r, norm_w, 1e-5)[0]
        assert rel(y, R.linear(normed.float(), w.float(), f(b))) < TOL[dtype] / 2


ACTS = {"silu": ("add_rms_norm_gate_up", "silu_and_mul"), "gelu": ("add_rms_norm_gate_up_gelu", "gelu_tanh_and_mul")}


@pytest.mark.parametrize("act_name", list(ACTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_add_rms_norm_gate_up(dtype, m, n, k, act_name):
    """The MLP's input: norm, [gate | up] projection and SiLU-and-mul (or Gemma's GeGLU, gelu_tanh(gate) * up);
    with and without a residual. Against fp32,
    fp16 gets twice the tolerance, and either dtype `bound`'s: the op carries the roundings of three (the norm,
    the projection's gate and up, SiLU-and-mul), each as the reference rounds them. That it rounds as the
    reference does is checked tightly on the gemv path, against the reference's steps in the dtype with an fp32
    projection. At least 64 outputs a row, so that the norms average over more than a handful."""
    n = max(n, 64)
    x, w = data(m, 2 * n, k, dtype)
    x = x.contiguous()
    res = torch.randn(m, k, device="cuda").to(dtype) * 2
    norm_w = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    assert K._norm_gemv_ok(x, res, norm_w, w) == uses_gemv(dtype, m, k)
    op, act_op = ACTS[act_name]
    for r in (None, res):
        poison()
        act, new_res = getattr(K, op)(x, r, norm_w, 1e-5, w)
        ref_act, ref_res = getattr(R, op)(x.float(), None if r is None else r.float(), norm_w.float(), 1e-5,
                                          w.float())
        tol = bound(dtype, getattr(R, op)(x, r, norm_w, 1e-5, w)[0], ref_act)
        if dtype == torch.float16:
            tol = max(tol, 2 * TOL[dtype])
        assert act.shape == (m, n) and rel(act, ref_act) < tol and rel(new_res, ref_res) < TOL[dtype]
        if uses_gemv(dtype, m, k):               # (cuBLAS's fp16 sums are not fp32's)
            normed = R.rms_norm(x, norm_w, 1e-5) if r is None else R.fused_add_rms_norm(x, r, norm_w, 1e-5)[0]
            same = getattr(R, act_op)(R.linear(normed.float(), w.float()).to(dtype))
            assert rel(act, same) < TOL[dtype] / 2


@pytest.mark.parametrize("op", ["add_rms_norm_linear", "add_rms_norm_gate_up_gelu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 4096, 3584), (2, 28672, 3584), (1, 6144, 4096), (3, 4096, 3584),
                                   (1, 64, 2056)])
def test_pre_norm_prologue(dtype, m, n, k, op):
    """A pre-norm of x (Gemma's post-norm of the previous block) as the gemv's first prologue: the result and
    the summed residual against the reference in fp32, and against the reference's own roundings in the dtype
    (the pre-norm's, the residual add's, the norm's) with an fp32 projection; past GEMV_MAX_M rows, or without
    a residual, the pre-norm runs as a kernel of its own first."""
    x, w = data(m, 2 * n if op.endswith("gelu") else n, k, dtype)
    x = (x.contiguous() * 30).to(dtype)                 # o_proj's output: far from unit scale before its norm
    res = torch.randn(m, k, device="cuda").to(dtype) * 2
    norm_w = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    pre = ((1 + 0.1 * torch.randn(k, device="cuda")).to(dtype), 1e-6)
    fused = K._pre_norm_gemv_ok(x, res, pre, w) and uses_gemv(dtype, m, k)
    assert fused == (dtype != torch.float32 and m <= K.GEMV_MAX_M and k % 8 == 0)
    for r in (res, None):
        poison()
        y, new_res = getattr(K, op)(x, r, norm_w, 1e-5, w, pre_norm=pre)
        f = lambda t: None if t is None else t.float()  # noqa: E731
        ref_y, ref_res = getattr(R, op)(x.float(), f(r), norm_w.float(), 1e-5, w.float(),
                                        pre_norm=(pre[0].float(), pre[1]))
        in_dtype = getattr(R, op)(x, r, norm_w, 1e-5, w, pre_norm=pre)[0]
        tol = max(bound(dtype, in_dtype, ref_y), 2 * TOL[dtype] if dtype == torch.float16 else 0)
        assert rel(y, ref_y) < tol and rel(new_res, ref_res) < TOL[dtype], (r is None, rel(y, ref_y))
        if fused and r is not None:
            pre_x = R.rms_norm(x, *pre)
            normed, same_res = R.fused_add_rms_norm(pre_x, r, norm_w, 1e-5)
            same = R.linear(normed.float(), w.float()).to(dtype)
            if op.endswith("gelu"):
                same = R.gelu_tanh_and_mul(same)
            assert rel(y, same) < TOL[dtype] / 2 and rel(new_res, same_res) < TOL[dtype] / 2


@pytest.mark.parametrize("pdl", [True, False])
def test_captured_by_a_cuda_graph_and_replayed_on_new_inputs(pdl):
    """A chain of dependent gemv kernels in a graph, captured with programmatic dependent launch (each one
    starts before the previous has finished, and waits for its results) and without (KernelConfig.pdl)."""
    ops = get_ops("cuda", KernelConfig(pdl=pdl))
    dt = torch.bfloat16
    x, w = data(1, 6144, 4096, dt)
    x = x.contiguous()
    res = torch.randn_like(x)
    norm_w = torch.ones(4096, device="cuda", dtype=dt)
    o = (torch.randn(4096, 4096, device="cuda") / 64).to(dt)
    gate_up = (torch.randn(2 * 14336, 4096, device="cuda") / 64).to(dt)
    down = (torch.randn(4096, 14336, device="cuda") / 120).to(dt)
    assert K._gemv_ok(x, w, 4096) and K._gemv_ok(x, o, 4096) and K._norm_gemv_ok(x, res, norm_w, gate_up)

    def step():                                  # each kernel reads what the one before it wrote
        y, r = ops.add_rms_norm_linear(x, res, norm_w, 1e-5, w)
        h = ops.linear(y[:, :4096], o)
        act, r2 = ops.add_rms_norm_gate_up(h, r, norm_w, 1e-5, gate_up)
        return y, r, h, act, r2, ops.linear(act, down)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        y, r = R.add_rms_norm_linear(x.float(), res.float(), norm_w.float(), 1e-5, w.float())
        h = R.linear(outs[0][:, :4096].float(), o.float())
        act, r2 = R.add_rms_norm_gate_up(outs[2].float(), outs[1].float(), norm_w.float(), 1e-5, gate_up.float())
        refs = (y, r, h, act, r2, R.linear(outs[3].float(), down.float()))
        for out, ref in zip(outs, refs):
            assert rel(out, ref) < TOL[dt]
