"""The CPU's weight-only integer weights (kernels/int_weight.py) against plain torch on random data: int4's
groups reproduce Q4_1's values exactly, the GEMMs equal x · dequantized weightᵀ, a row reordering keeps each
row's codes, int8 rows the same."""
from __future__ import annotations

import pytest
import torch

from mii_async.kernels import reference as R
from mii_async.kernels.int_weight import GROUP, quantize_int4, quantize_int8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float())).item()


def q4_1_weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights as a Q4_1 file dequantizes them: d·q + m per group of 32, each group's codes spanning 0…15 (the
    quantizer maps a group's min to 0 and its max to 15), d and m fp16 values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // GROUP, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(n, k // GROUP, 1, generator=g) * 0.05).half().float()
    return (d * q + m).reshape(n, k)


@pytest.mark.parametrize("n,k", [(64, 32), (960, 576), (576, 1536), (3072, 576)])
def test_q4_1_weights_come_back_exactly(n, k):
    w = q4_1_weights(n, k, seed=n + k)
    back = quantize_int4(w, torch.float32).dequantize(torch.float32)
    assert torch.allclose(back, w, rtol=0, atol=1e-6 * w.abs().max().item())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("t", [1, 3, 17, 64])
def test_int4_linear_is_x_times_its_weights(dtype, tol, t):
    w = torch.randn(192, 256)
    q = quantize_int4(w, dtype)
    deq = q.dequantize(torch.float32)
    assert rel(deq, w) < 0.1                                     # 4 bits a weight: within a group's step
    assert (deq - w).abs().max() <= (w.reshape(192, -1, GROUP).amax(-1) - w.reshape(192, -1, GROUP).amin(-1)).max() / 15
    x = torch.randn(t, 256).to(dtype)
    bias = torch.randn(192).to(dtype)
    assert rel(R.linear(x, q, bias), x.float() @ deq.t() + bias.float()) < tol


def test_int4_rows_reordered_keep_their_codes():
    w = q4_1_weights(128, 64, seed=3)
    q = quantize_int4(w, torch.float32)
    order = torch.randperm(128)
    moved = q.map_rows(lambda t: t[order])
    assert torch.equal(moved.dequantize(torch.float32), q.dequantize(torch.float32)[order])


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(8, 48), torch.float32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_int8_rows(dtype, tol):
    w = torch.randn(1000, 128)
    w[7] = 0                                                      # an all-zero row keeps a usable scale
    q = quantize_int8(w, dtype)
    deq = q.dequantize(torch.float32)
    assert rel(deq, w) < 1e-2 and torch.all(deq[7] == 0)
    x = torch.randn(5, 128).to(dtype)
    assert rel(R.linear(x, q), x.float() @ deq.t()) < tol
