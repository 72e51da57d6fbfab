"""Every CuPy/CUDA kernel against its torch reference in fp32, on fresh random data with poisoned outputs:
relative error ‖out − ref‖ / ‖ref‖ ≤ 1e-2 in bf16 and ≤ 1e-3 in fp16 (fp32: 1e-5)."""
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
from mii_async.kernels import get_ops  # noqa: E402
from mii_async.kernels import reference as R  # noqa: E402
from mii_async.kernels.config import KernelConfig  # noqa: E402
from mii_async.kernels.kv_store import FP8_KV  # noqa: E402
from mii_async.kernels.metadata import AttentionMetadata  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values (poison left in the output?)"
    return (torch.linalg.norm(out.float() - ref.float()) / torch.linalg.norm(ref.float())).item()


def poison() -> None:
    """Fills the caching allocator's free memory with NaN, so that an output the kernel forgot is caught."""
    x = torch.full((256 << 20,), float("nan"), device="cuda")
    del x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 64), (7, 576), (300, 4096), (33, 5120), (2, 8192), (3, 100), (4, 4100)])
def test_norms(dtype, t, h):
    """rms_norm and fused_add_rms_norm, rows of many widths (16-byte vectors, and widths that take the scalar
    loop), strided input rows included."""
    x = torch.randn(t, 2 * h, device="cuda").to(dtype)[:, :h]      # strided rows
    res = torch.randn(t, h, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(h, device="cuda")).to(dtype)
    poison()
    out = K.rms_norm(x, w, 1e-5)
    assert rel(out, R.rms_norm(x.float(), w.float(), 1e-5)) < TOL[dtype]
    poison()
    out, new_res = K.fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = R.fused_add_rms_norm(x.float(), res.float(), w.float(), 1e-6)
    assert rel(out, ref_out) < TOL[dtype] and rel(new_res, ref_res) < TOL[dtype]
    same_dtype = R.fused_add_rms_norm(x, res, w, 1e-6)           # rounding follows the reference's steps
    assert rel(out, same_dtype[0]) < TOL[dtype] / 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,f", [(1, 160), (5, 1536), (257, 14336), (2048, 14336), (3, 100), (6, 1002)])
def test_silu_and_mul(dtype, t, f):
    """silu(gate) * up over [gate | up] rows, in 16-byte vectors and (widths not a whole number of them)
    one element at a time."""
    x = torch.randn(t, 2 * f, device="cuda").to(dtype) * 3
    poison()
    assert rel(K.silu_and_mul(x), R.silu_and_mul(x.float())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64), (8, 8, 64), (28, 4, 128)])
def test_rotary_write_kv(dtype, hq, hkv, d):
    """Rotary on q and k of a fused QKV projection, k and v written at their slots, every other slot untouched;
    positions up to 32k."""
    from mii_async.workers.model.rope import cos_sin_cache, inv_frequencies

    t, num_blocks, bs = 37, 64, 16
    cos_sin = cos_sin_cache(inv_frequencies(d, 500000.0, None), 32768, torch.device("cuda"))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda").to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    positions = torch.randint(0, 32768, (t,), device="cuda")
    slots = torch.randperm(num_blocks * bs, device="cuda")[:t]
    kc = torch.full((num_blocks, bs, hkv, d), float("nan"), device="cuda", dtype=dtype)
    vc = kc.clone()
    ref_k, ref_v = kc.float().clone(), vc.float().clone()
    poison()
    q_out = K.rotary_write_kv(positions, q, k, v, cos_sin, kc, vc, slots)
    ref_q = R.rotary_write_kv(positions, q.float(), k.float(), v.float(), cos_sin, ref_k, ref_v, slots)
    assert rel(q_out, ref_q) < TOL[dtype]
    flat = slots.tolist()
    written = torch.zeros(num_blocks * bs, dtype=torch.bool, device="cuda")
    written[flat] = True
    assert torch.isnan(kc.view(-1, hkv, d)[~written]).all() and torch.isnan(vc.view(-1, hkv, d)[~written]).all()
    assert rel(kc.view(-1, hkv, d)[flat], ref_k.view(-1, hkv, d)[flat]) < TOL[dtype]
    assert torch.equal(vc.view(-1, hkv, d)[flat].float(), ref_v.view(-1, hkv, d)[flat])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 37])
@pytest.mark.parametrize("hq,hkv,d", [(32, 4, 128), (16, 8, 256), (40, 40, 64), (6, 2, 16), (9, 3, 96)])
def test_rotary_write_kv_with_head_norms(dtype, t, hq, hkv, d):
    """With q/k head norms (Qwen3, Gemma 3): against the reference in fp32, and in 16-bit types with the norms
    fused into the rotary kernel (d of 16 · 2^n up to 256) equal bit for bit to the norm kernel followed by
    the plain rotary kernel; d = 96 and fp32 take the norm kernels first."""
    from mii_async.workers.model.rope import cos_sin_cache, inv_frequencies

    cos_sin = cos_sin_cache(inv_frequencies(d, 1000000.0, None), 4096, torch.device("cuda"))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda").to(dtype) * 3
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    norms = ((1 + 0.2 * torch.randn(d, device="cuda")).to(dtype), (1 + 0.2 * torch.randn(d, device="cuda")).to(dtype))
    positions = torch.randint(0, 4096, (t,), device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:t]
    caches = [torch.full((64, 16, hkv, d), float("nan"), device="cuda", dtype=dtype) for _ in range(4)]
    ref_k, ref_v = caches[0].float().clone(), caches[1].float().clone()
    poison()
    q_out = K.rotary_write_kv(positions, q, k, v, cos_sin, caches[0], caches[1], slots, (*norms, 1e-6))
    ref_q = R.rotary_write_kv(positions, q.float(), k.float(), v.float(), cos_sin, ref_k, ref_v, slots,
                              (norms[0].float(), norms[1].float(), 1e-6))
    flat = slots.tolist()
    assert rel(q_out, ref_q) < TOL[dtype]
    assert rel(caches[0].view(-1, hkv, d)[flat], ref_k.view(-1, hkv, d)[flat]) < TOL[dtype]
    assert torch.equal(caches[1].view(-1, hkv, d)[flat].float(), ref_v.view(-1, hkv, d)[flat])
    qn = K.rms_norm(q.reshape(t * hq, d), norms[0], 1e-6).view(t, hq, d)
    kn = K.rms_norm(k.reshape(t * hkv, d), norms[1], 1e-6).view(t, hkv, d)
    two_q = K.rotary_write_kv(positions, qn, kn, v, cos_sin, caches[2], caches[3], slots)
    assert torch.equal(q_out, two_q) and torch.equal(caches[0].view(-1, hkv, d)[flat], caches[2].view(-1, hkv, d)[flat])


def _paged(context_lens: list[int], hkv: int, d: int, bs: int, dtype: torch.dtype, seed: int):
    """Random caches holding each sequence's keys in randomly placed blocks; the block tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nbs = [-(-c // bs) for c in context_lens]
    total = sum(nbs) + 3
    kc = torch.randn(total, bs, hkv, d, device="cuda", generator=g).to(dtype)
    vc = torch.randn(total, bs, hkv, d, device="cuda", generator=g).to(dtype)
    perm = torch.randperm(total, device="cuda", generator=g).tolist()
    width = max(nbs)
    tables, at = [], 0
    for nb in nbs:
        tables.append(perm[at:at + nb] + [0] * (width - nb))
        at += nb
    return kc, vc, torch.tensor(tables, device="cuda")


def _meta(query_lens, context_lens, tables):
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    nd = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    dev = tables.device
    return AttentionMetadata(torch.zeros(sum(query_lens), dtype=torch.int64, device=dev), tables,
                             torch.tensor(context_lens, device=dev), torch.tensor(qsl, device=dev), nd,
                             max(context_lens), list(query_lens), list(context_lens))


DECODE_CASES = [  # (context lengths, Hq, Hkv, D, block size)
    ([1], 32, 8, 128, 16),
    ([5, 17, 512, 513, 1024, 1025], 32, 8, 128, 16),
    ([32768], 32, 8, 128, 16),
    ([32768, 3, 20000], 9, 3, 64, 32),
    ([random.Random(0).randrange(1, 4096) for _ in range(64)], 32, 8, 128, 16),
    ([random.Random(1).randrange(1, 2048) for _ in range(160)], 32, 8, 128, 16),   # 1280 (sequence, KV head) pairs
    ([100, 2000, 7], 8, 8, 64, 16),
    ([300, 4000], 16, 1, 128, 16),
    ([777, 9], 28, 4, 128, 32),
    ([250, 60], 8, 2, 256, 16),
]


DECODE_KERNELS = ["mma", "stream", "split"]   # mma: head dim 128, G <= 16; stream: G <= 4; 16-bit (else split)


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_paged_attention_decode(dtype, case, kernel):
    """The decode kernels (tensor-core, one-pass streamed, split two-phase; flash-decoding splits) vs the reference:
    contexts 1 … 32k, partition edges, GQA ratios 1 … 16, head dims 64 … 256, block sizes 16 and 32, ragged
    batches."""
    clens, hq, hkv, d, bs = DECODE_CASES[case]
    kc, vc, tables = _paged(clens, hkv, d, bs, dtype, seed=case)
    q = torch.randn(len(clens), hq, d, device="cuda").to(dtype)
    meta = _meta([1] * len(clens), clens, tables)
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, d ** -0.5)
    poison()
    out = K.paged_attention(q, kc, vc, meta, d ** -0.5, config=KernelConfig(decode_kernel=kernel))
    assert rel(out, ref) < TOL[dtype], (clens[:4], hq, hkv, d)


@pytest.mark.parametrize("kernel", DECODE_KERNELS + ["mma/2"])
@pytest.mark.parametrize("partition", DA.PARTITIONS + (96, 336, 672))
def test_paged_attention_decode_every_partition(partition, kernel):
    """Each split length the adaptive choice may take gives the reference's answer (contexts shorter and
    longer than it, one that ends on its edge), in every kernel and both mma widths (mma/2: 2 warps a block);
    the whole-wave lengths are multiples of the cache block, not powers of two."""
    kernel, _, warps = kernel.partition("/")
    clens = [1, partition, partition + 1, 3 * partition + 5, 1000]
    kc, vc, tables = _paged(clens, 8, 128, 16, torch.bfloat16, seed=partition)
    q = torch.randn(len(clens), 32, 128, device="cuda").to(torch.bfloat16)
    meta = _meta([1] * len(clens), clens, tables)
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 128 ** -0.5)
    poison()
    out = K.paged_attention_decode(q, kc, vc, meta.block_tables, meta.context_lens, max(clens), 128 ** -0.5,
                                   partition=partition, kernel=kernel, warps=int(warps) if warps else None)
    assert rel(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("kernel", DECODE_KERNELS + ["mma/2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, "fp8"])
@pytest.mark.parametrize("window", [None, 700])
def test_decode_splits_shared_evenly(kernel, dtype, window):
    """A launch sized for a context cap far past its sequences' contexts (a long-cap CUDA graph: 49 splits of up
    to 672 tokens over 32768), with each sequence's span shared evenly by the splits (min_partition 32) and in
    fixed splits (min_partition = partition): the reference's answer either way, over contexts of 1 token to
    the cap, within a sliding window and without; over an e4m3 cache too."""
    kernel, _, warps = kernel.partition("/")
    clens = [1, 17, 300, 9000, 20000, 32768]
    fp8 = dtype == "fp8"
    kc, vc, tables = _paged(clens, 8, 128, 16, torch.bfloat16, seed=11)
    q = torch.randn(len(clens), 32, 128, device="cuda").to(torch.bfloat16)
    meta = _meta([1] * len(clens), clens, tables)
    if fp8:                                      # the reference reads the e4m3 values the kernels read
        kc, vc = kc.to(FP8_KV), vc.to(FP8_KV)
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 128 ** -0.5, window=window)
    for least in (32, 672):
        poison()
        out = K.paged_attention_decode(q, kc, vc, meta.block_tables, meta.context_lens, 32768, 128 ** -0.5,
                                       partition=672, min_partition=least, kernel=kernel, window=window,
                                       warps=int(warps) if warps else None)
        assert rel(out, ref) < TOL[torch.bfloat16], least


@pytest.mark.parametrize("kernel", DECODE_KERNELS + ["mma/2"])
def test_decode_grid_orders_agree(kernel):
    """Both launch orders of the grid (KV heads first, the default; sequences first, compiled apart) give the
    reference's answer, with one split and with several (the combine counts each (sequence, KV head) apart),
    bit for bit the same as each other."""
    kernel, _, warps = kernel.partition("/")
    clens = [1, 31, 300, 513, 1024, 2500, 77]
    kc, vc, tables = _paged(clens, 8, 128, 16, torch.bfloat16, seed=3)
    q = torch.randn(len(clens), 32, 128, device="cuda").to(torch.bfloat16)
    meta = _meta([1] * len(clens), clens, tables)
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 128 ** -0.5)
    for partition in (None, 128, 4096):
        outs = []
        for grid in DA.GRID_ORDERS:
            poison()
            outs.append(K.paged_attention_decode(q, kc, vc, meta.block_tables, meta.context_lens, max(clens),
                                                 128 ** -0.5, partition=partition, kernel=kernel,
                                                 warps=int(warps) if warps else None, grid=grid))
            assert rel(outs[-1], ref) < TOL[torch.bfloat16], (grid, partition)
        assert torch.equal(outs[0], outs[1]), partition


@pytest.mark.parametrize("config", [KernelConfig(decode_kernel="split"), KernelConfig(mma_narrow_from=0),
                                    KernelConfig(decode_kernel="stream", decode_grid="sequences")], ids=repr)
def test_the_op_set_runs_the_decode_kernel_its_config_names(config):
    """get_ops("cuda", config).paged_attention gives, bit for bit, what the decode call gives when asked for the
    same kernel, width and grid order by argument; the default op set's answer differs from the split
    kernel's, so the comparison tells kernels apart."""
    clens = [1, 31, 300, 513, 1024, 2500, 77]
    kc, vc, tables = _paged(clens, 8, 128, 16, torch.bfloat16, seed=5)
    q = torch.randn(len(clens), 32, 128, device="cuda").to(torch.bfloat16)
    meta = _meta([1] * len(clens), clens, tables)
    asked = K.paged_attention_decode(q, kc, vc, meta.block_tables, meta.context_lens, max(clens), 128 ** -0.5,
                                     kernel=config.decode_kernel, warps=config.mma_warps(len(clens) * 8),
                                     grid=config.decode_grid)
    assert torch.equal(get_ops("cuda", config).paged_attention(q, kc, vc, meta, 128 ** -0.5), asked)
    if config.decode_kernel == "split":
        assert not torch.equal(get_ops("cuda").paged_attention(q, kc, vc, meta, 128 ** -0.5), asked)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 7, 8, 12, 16])
def test_one_pass_decode_kernels_match_the_split_kernel(dtype, g):
    """The tensor-core kernel (every GQA ratio up to its 16 rows, blocks of 4 warps and of 2) and the streamed
    one (up to 4), both 16-bit types, block sizes 16 and 32, contexts across their 16-token tiles and rings:
    the split kernel's answer and the reference's."""
    clens = [1, 15, 16, 17, 63, 64, 65, 200, 511, 777, 2049, 5000]
    for bs in (16, 32):
        kc, vc, tables = _paged(clens, 4, 128, bs, dtype, seed=10 * g + bs)
        q = torch.randn(len(clens), 4 * g, 128, device="cuda").to(dtype)
        meta = _meta([1] * len(clens), clens, tables)
        ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 128 ** -0.5)
        split = K.paged_attention_decode(q, kc, vc, meta.block_tables, meta.context_lens, max(clens), 128 ** -0.5,
                                         kernel="split")
        for kernel, warps in (("mma", 4), ("mma", 2), ("stream", None))[:3 if g <= 4 else 2]:
            poison()
            out = K.paged_attention_decode(q, kc, vc, meta.block_tables, meta.context_lens, max(clens),
                                           128 ** -0.5, kernel=kernel, warps=warps)
            assert rel(out, ref) < TOL[dtype] and rel(out, split) < TOL[dtype], (kernel, warps, g, bs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_attention(dtype):
    """A SplitFuse batch (decodes first, then prompt chunks attending to earlier chunks) matches the reference."""
    qlens, clens = [1, 1, 1, 40, 7, 300], [900, 5, 64, 40, 77, 1300]
    kc, vc, tables = _paged(clens, 8, 128, 16, dtype, seed=7)
    q = torch.randn(sum(qlens), 32, 128, device="cuda").to(dtype)
    meta = _meta(qlens, clens, tables)
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 128 ** -0.5)
    poison()
    assert rel(K.paged_attention(q, kc, vc, meta, 128 ** -0.5), ref) < TOL[dtype]


PREFILL_CASES = [  # (query lengths, context lengths, Hq, Hkv, D, block size, keys per group)
    ([1, 1, 1, 40, 7, 300], [900, 5, 64, 40, 77, 1300], 32, 8, 128, 16, 16384),
    ([128] * 16, [128] * 16, 32, 8, 128, 16, 16384),                 # an offline step: 16 fresh prompts
    ([512, 512, 1024], [512, 4096, 8192], 32, 8, 128, 16, 4096),      # chunks over long caches, 3 groups
    ([1] * 64 + [3, 1, 17], [700] * 64 + [3, 2000, 40], 28, 4, 128, 32, 16384),
    ([33, 65], [33, 1000], 9, 3, 64, 16, 64),                          # a group per chunk
    ([250, 1], [260, 300], 8, 2, 256, 16, 16384),
    ([9, 100], [9, 150], 16, 16, 64, 16, 16384),                       # no GQA
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_ragged_prefill_attention(dtype, case):
    """Prompt chunks through the ragged (variable-length flash) path, with the layout the runner builds:
    fresh prompts, chunks over earlier chunks, one-token chunks after the decodes, groups split by the key
    limit, GQA ratios 1 … 7, head dims 64 … 256."""
    import numpy as np

    from mii_async.kernels.metadata import device_groups, prefill_layout

    qlens, clens, hq, hkv, d, bs, limit = PREFILL_CASES[case]
    kc, vc, tables = _paged(clens, hkv, d, bs, dtype, seed=100 + case)
    q = torch.randn(sum(qlens), hq, d, device="cuda").to(dtype)
    meta = _meta(qlens, clens, tables)
    layout, groups = prefill_layout(tables.cpu().numpy().astype(np.int64), qlens, clens, meta.num_decodes, bs,
                                    max_group_keys=limit)
    meta = meta._replace(prefill_groups=device_groups(torch.from_numpy(layout).cuda(), groups))
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, d ** -0.5)
    poison()
    out = K.paged_attention(q, kc, vc, meta, d ** -0.5)
    assert rel(out, ref) < TOL[dtype], (case, len(groups))


def test_kernels_are_captured_by_cuda_graphs():
    """The decode attention and norm kernels launched on torch's stream are captured and replayed by a graph."""
    clens = [700, 30]
    kc, vc, tables = _paged(clens, 8, 128, 16, torch.bfloat16, seed=3)
    q = torch.randn(2, 32, 128, device="cuda").to(torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    meta = _meta([1, 1], clens, tables)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        K.paged_attention(q, kc, vc, meta, 0.1)                   # warm-up: compile outside the capture
        K.rms_norm(q.view(2, 4096), w, 1e-5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.paged_attention(q, kc, vc, meta, 0.1)
        normed = K.rms_norm(out.view(2, 4096), w, 1e-5)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 0.1)
    assert rel(out, ref) < 1e-2
    assert rel(normed, R.rms_norm(ref.view(2, 4096), w.float(), 1e-5)) < 1e-2
