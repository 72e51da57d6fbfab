"""FP8 weights on the CPU: the quantize / dequantize definitions, the block scales' layout through row maps and
concatenation, the reference ops' dequantize-then-project, and the _scaled_mm layouts of fp8_linear.py (torch
implements the row-wise _scaled_mm on the CPU)."""
from __future__ import annotations

import pytest
import torch

from mii_async.kernels import reference as R
from mii_async.kernels.fp8_linear import dense_linear, scaled_linear
from mii_async.kernels.fp8_weight import (E4M3, E4M3_MAX, FP8Weight, block_rows, cat_rows, dequantize,
                                          quantize_activations, quantize_blocks, quantize_weight)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float())).item()


def blocked(w: torch.Tensor) -> FP8Weight:
    q, blocks = quantize_blocks(w)
    return FP8Weight(q, block_rows(blocks, 0, w.shape[0]))


def test_per_channel_quantization():
    """Each row's largest magnitude maps to 448; the dequantized weight is within e4m3's half-step (1/16) of the
    original, and a zero row stays zero with a positive scale."""
    torch.manual_seed(0)
    w = torch.randn(70, 48) * torch.linspace(0.01, 10, 70)[:, None]
    w[3] = 0
    q = quantize_weight(w)
    assert q.weight.dtype == E4M3 and q.scale.shape == (70,) and (q.scale > 0).all()
    assert torch.allclose(q.weight.float().abs().amax(1)[torch.arange(70) != 3], torch.tensor(E4M3_MAX))
    d = q.dequantize(torch.float32)
    assert ((d - w).abs() <= w.abs() / 16 + q.scale[:, None] * 2 ** -9).all()
    assert (d[3] == 0).all()


def test_block_quantization_and_layout():
    """[128, 128] block scales of a weight whose sides are not multiples of 128: each tile's largest magnitude
    maps to 448; repeated per row they are held with strides (1, N) through row maps and concatenation."""
    torch.manual_seed(1)
    w = torch.randn(200, 300)
    q, blocks = quantize_blocks(w)
    assert blocks.shape == (2, 3)
    assert torch.allclose(q[:128, 256:].float().abs().amax(), torch.tensor(E4M3_MAX))
    f = blocked(w)
    assert f.scale.shape == (200, 3) and f.scale.stride() == (1, 200)
    assert rel(f.dequantize(torch.float32), w) < 0.05
    perm = torch.randperm(200)
    g = f.map_rows(lambda t: t[perm])
    assert g.scale.stride() == (1, 200) and torch.equal(g.dequantize(torch.float32), f.dequantize(torch.float32)[perm])
    both = cat_rows([f, g])
    assert both.scale.stride() == (1, 400) and both.shape == (400, 300)
    assert torch.equal(both.dequantize(torch.float32)[200:], g.dequantize(torch.float32))


def test_activation_quantization():
    """Per token, per token and 128 columns, and with a static scale: q · scale is within e4m3's half-step of x;
    a static scale saturates at ±448."""
    torch.manual_seed(2)
    x = torch.randn(9, 300).bfloat16() * 3
    for group in (None, 128):
        q, s = quantize_activations(x, group)
        assert s.shape == ((9,) if group is None else (9, 3))
        assert rel(dequantize(q, s), x) < 0.05
    q, s = quantize_activations(x, static_scale=torch.tensor([0.01]))
    assert (s == 0.01).all() and q.float().abs().max() == E4M3_MAX


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_reference_projects_the_dequantized_weight(kind):
    """The reference ops take an FP8 weight where they take a dense one: exactly the dequantized weight's
    results, in the activations' dtype."""
    torch.manual_seed(3)
    w = torch.randn(96, 256)
    f = quantize_weight(w) if kind == "channel" else blocked(w)
    x, res, nw = torch.randn(5, 256), torch.randn(5, 256), 1 + 0.1 * torch.randn(256)
    dense = f.dequantize(torch.float32)
    assert torch.equal(R.linear(x, f), R.linear(x, dense))
    assert torch.equal(R.add_rms_norm_linear(x, res, nw, 1e-5, f)[0], R.add_rms_norm_linear(x, res, nw, 1e-5, dense)[0])
    gu = quantize_weight(torch.randn(2 * 48, 256))
    assert torch.equal(R.add_rms_norm_gate_up(x, None, nw, 1e-5, gu)[0],
                       R.add_rms_norm_gate_up(x, None, nw, 1e-5, gu.dequantize(torch.float32))[0])
    xb = x.bfloat16()
    assert R.linear(xb, f).dtype == torch.bfloat16
    assert torch.equal(R.linear(xb, f), R.linear(xb, f.dequantize(xb.dtype)))


def test_scaled_linear_is_the_quantized_product():
    """scaled_linear (torch._scaled_mm, per-token × per-channel scales) is the product of the dequantized
    activations and weights, to bf16's rounding; with a bias added."""
    torch.manual_seed(4)
    x, w = torch.randn(7, 256).bfloat16(), quantize_weight(torch.randn(384, 256))
    bias = torch.randn(384).bfloat16()
    q, s = quantize_activations(x)
    want = dequantize(q, s) @ w.dequantize(torch.float32).t()
    assert rel(scaled_linear(q, s, w, None, torch.bfloat16), want) < 4e-3
    assert rel(scaled_linear(q, s, w, bias, torch.bfloat16), want + bias.float()) < 4e-3
    assert scaled_linear(q, s, w, None, torch.float16).dtype == torch.float16


def test_dense_fallback_in_slabs():
    """The dequantizing fallback gives the reference's numbers with the weight's rows taken a slab at a time."""
    import mii_async.kernels.fp8_linear as L

    torch.manual_seed(5)
    w, x = blocked(torch.randn(300, 256)), torch.randn(4, 256)
    bias = torch.randn(300)
    old, L.DEQUANT_SLAB = L.DEQUANT_SLAB, 128
    try:
        assert torch.allclose(dense_linear(x, w, bias), R.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    finally:
        L.DEQUANT_SLAB = old
