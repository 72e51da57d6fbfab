"""The CUDA attention ops with a sliding window and a logit soft-cap, against the torch reference in fp32 on
random data (relative error ≤ 1e-2 in bf16, 1e-3 in fp16, 1e-5 in fp32): the three decode kernels, every split
length and both grid orders, the prefill paths (variable-length flash with a window, SDPA per sequence, the
soft-capped fp32 path), a CUDA graph's replay; and GeGLU."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
cupy = pytest.importorskip("cupy")

from mii_async.kernels import cuda as K  # noqa: E402
from mii_async.kernels import decode_attention as DA  # noqa: E402
from mii_async.kernels import reference as R  # noqa: E402
from mii_async.kernels.config import KernelConfig  # noqa: E402

from .test_cuda_kernels import DTYPES, TOL, _meta, _paged, poison, rel  # noqa: E402

DECODE_CASES = [  # (context lengths, Hq, Hkv, D, block size, window, softcap)
    ([1, 5, 17, 100, 513, 1024, 4000], 32, 8, 128, 16, 100, None),
    ([300, 4000, 9000], 32, 8, 128, 16, 4096, 50.0),               # Mistral's window, Gemma 2's cap
    ([777, 9, 2048, 31], 28, 4, 128, 32, 33, 30.0),                # a window across blocks and partitions
    ([250, 60, 5000, 4097], 16, 8, 256, 16, 4096, 50.0),           # Gemma 2 9B's heads (D 256, G 2)
    ([32768], 32, 8, 128, 16, 4096, None),
    ([3000] * 8 + [1], 16, 2, 128, 16, 1, None),                   # each token sees itself only
    ([random.Random(2).randrange(1, 3000) for _ in range(64)], 32, 8, 128, 16, 512, 20.0),
    ([600, 70], 12, 4, 64, 16, 64, 5.0),                          # split kernel's head dim 64, G 3
]
DECODE_KERNELS = ["mma", "stream", "split"]


def _case(case: int, dtype: torch.dtype, seed: int):
    clens, hq, hkv, d, bs, window, softcap = DECODE_CASES[case]
    kc, vc, tables = _paged(clens, hkv, d, bs, dtype, seed=seed)
    q = (torch.randn(len(clens), hq, d, device="cuda") * 2).to(dtype)   # scores large enough for the cap
    meta = _meta([1] * len(clens), clens, tables)
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, d ** -0.5, window=window, softcap=softcap)
    return q, kc, vc, meta, ref, window, softcap, d


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_kernels_honour_window_and_softcap(dtype, case, kernel):
    """Each decode kernel (or the one it falls to for the shape) with the window and cap: the reference's
    answer, for contexts shorter and longer than the window."""
    q, kc, vc, meta, ref, window, softcap, d = _case(case, dtype, seed=case)
    poison()
    out = K.paged_attention(q, kc, vc, meta, d ** -0.5, window=window, softcap=softcap,
                            config=KernelConfig(decode_kernel=kernel))
    assert rel(out, ref) < TOL[dtype], (case, kernel)
    longest = max(range(len(meta.context_lens_host)), key=meta.context_lens_host.__getitem__)
    if window is not None and meta.context_lens_host[longest] > window:   # the window changed the answer
        dense = R.paged_attention(q.float(), kc.float(), vc.float(), meta, d ** -0.5, softcap=softcap)
        assert rel(dense[longest], ref[longest]) > TOL[dtype]


@pytest.mark.parametrize("kernel", DECODE_KERNELS + ["mma/2"])
@pytest.mark.parametrize("partition", DA.PARTITIONS)
def test_every_partition_with_a_window(partition, kernel):
    """Each split length, in every kernel and both mma widths: partitions that start mid-block at the window's
    first token, windows shorter and longer than a partition, and a context that ends on a partition edge."""
    kernel, _, warps = kernel.partition("/")
    clens = [1, partition, partition + 1, 3 * partition + 5, 1000, 2500]
    kc, vc, tables = _paged(clens, 8, 128, 16, torch.bfloat16, seed=partition)
    q = (torch.randn(len(clens), 32, 128, device="cuda") * 2).to(torch.bfloat16)
    meta = _meta([1] * len(clens), clens, tables)
    for window, softcap in ((partition // 2 + 3, None), (2 * partition + 7, 30.0), (700, 10.0)):
        ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 128 ** -0.5, window=window,
                                softcap=softcap)
        poison()
        out = K.paged_attention_decode(q, kc, vc, meta.block_tables, meta.context_lens, max(clens), 128 ** -0.5,
                                       partition=partition, kernel=kernel, warps=int(warps) if warps else None,
                                       window=window, softcap=softcap)
        assert rel(out, ref) < TOL[torch.bfloat16], (window, softcap)


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
def test_grid_orders_agree_with_a_window(kernel):
    """Both launch orders give the same bits with a window and a cap, with one split and with several."""
    clens = [1, 31, 300, 513, 1024, 2500, 77]
    kc, vc, tables = _paged(clens, 8, 128, 16, torch.bfloat16, seed=4)
    q = torch.randn(len(clens), 32, 128, device="cuda").to(torch.bfloat16)
    meta = _meta([1] * len(clens), clens, tables)
    for partition in (None, 128, 4096):
        outs = [K.paged_attention_decode(q, kc, vc, meta.block_tables, meta.context_lens, max(clens), 128 ** -0.5,
                                         partition=partition, kernel=kernel, grid=grid, window=400, softcap=25.0)
                for grid in DA.GRID_ORDERS]
        assert torch.equal(outs[0], outs[1]), partition


PREFILL_CASES = [  # (query lengths, context lengths, Hq, Hkv, D, block size, window, softcap)
    ([1, 1, 1, 40, 7, 300], [900, 5, 64, 40, 77, 1300], 32, 8, 128, 16, 64, None),
    ([512, 512, 1024], [512, 4096, 8192], 32, 8, 128, 16, 4096, None),
    ([250, 1, 33], [260, 300, 5000], 16, 8, 256, 16, 100, 50.0),
    ([1] * 8 + [3, 17, 129], [700] * 8 + [3, 2000, 129], 28, 4, 128, 32, 128, 30.0),
    ([9, 100], [9, 150], 16, 16, 64, 16, 1, None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_with_window_and_softcap(dtype, case, ragged):
    """Decodes and prompt chunks in one step with a window (and a cap in some): through the variable-length
    flash path with the runner's layout (ragged) or the layout built on the spot, SDPA per sequence in fp32,
    the reference's fp32 path where capped: the reference's answer."""
    import numpy as np

    from mii_async.kernels.metadata import device_groups, prefill_layout

    qlens, clens, hq, hkv, d, bs, window, softcap = PREFILL_CASES[case]
    kc, vc, tables = _paged(clens, hkv, d, bs, dtype, seed=200 + case)
    q = torch.randn(sum(qlens), hq, d, device="cuda").to(dtype)
    meta = _meta(qlens, clens, tables)
    if ragged:
        layout, groups = prefill_layout(tables.cpu().numpy().astype(np.int64), qlens, clens, meta.num_decodes, bs)
        meta = meta._replace(prefill_groups=device_groups(torch.from_numpy(layout).cuda(), groups))
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, d ** -0.5, window=window, softcap=softcap)
    poison()
    out = K.paged_attention(q, kc, vc, meta, d ** -0.5, window=window, softcap=softcap)
    assert rel(out, ref) < TOL[dtype], case


def test_windowed_capped_decode_is_captured_by_a_graph():
    """The decode kernels with a window and a cap (per-layer constants) are captured and replayed: a replay
    over new queries gives the reference's answer."""
    clens = [700, 30, 5000]
    kc, vc, tables = _paged(clens, 8, 128, 16, torch.bfloat16, seed=9)
    q = torch.randn(3, 32, 128, device="cuda").to(torch.bfloat16)
    meta = _meta([1, 1, 1], clens, tables)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        K.paged_attention(q, kc, vc, meta, 0.1, window=256, softcap=20.0)      # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.paged_attention(q, kc, vc, meta, 0.1, window=256, softcap=20.0)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 0.1, window=256, softcap=20.0)
    assert rel(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 2, 7, 300])
def test_gelu_gate_up(dtype, t):
    """GeGLU and its norm-fused form (gemv.cu at 1–2 rows) against the reference."""
    h, f = 256, 512
    x = torch.randn(t, h, device="cuda").to(dtype)
    res = torch.randn(t, h, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(h, device="cuda")).to(dtype)
    gate_up = (torch.randn(2 * f, h, device="cuda") * h ** -0.5).to(dtype)
    poison()
    y, new_res = K.add_rms_norm_gate_up_gelu(x, res, w, 1e-6, gate_up)
    ref_y, ref_res = R.add_rms_norm_gate_up_gelu(x.float(), res.float(), w.float(), 1e-6, gate_up.float())
    assert rel(y, ref_y) < TOL[dtype] and rel(new_res, ref_res) < TOL[dtype]
    z = torch.randn(t, 2 * f, device="cuda").to(dtype) * 3
    assert rel(K.gelu_tanh_and_mul(z), R.gelu_tanh_and_mul(z.float())) < TOL[dtype]
