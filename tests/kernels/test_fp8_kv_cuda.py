"""An FP8 (e4m3) KV cache on the CUDA op set: the rotary + KV-write kernel writes the bytes the model-dtype cache
rounds to, the decode kernels (tensor-core mma and split; stream gives way to split) and the prompt path read it as
the reference does over the same bytes widened, in both grid orders, with windows and soft-caps, inside a CUDA
graph; the default model with an FP8 cache still answers the capital question."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("an FP8 cache on the CUDA kernels needs compute capability 8.9", allow_module_level=True)

from mii_async.kernels import cuda as K  # noqa: E402
from mii_async.kernels import decode_attention as DA  # noqa: E402
from mii_async.kernels import reference as R  # noqa: E402
from mii_async.kernels.config import KernelConfig  # noqa: E402
from mii_async.kernels.kv_store import FP8_KV  # noqa: E402

from .test_cuda_kernels import DECODE_CASES as CUDA_DECODE_CASES  # noqa: E402
from .test_cuda_kernels import _meta, _paged, poison, rel  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(FP8_KV)


def _fp8_paged(clens, hkv, d, bs, seed, amplitude=3.0):
    """Random e4m3 caches (values up to ~amplitude · 4, so that subnormals, normals and the top of the range
    all occur) and their block tables."""
    kc, vc, tables = _paged(clens, hkv, d, bs, torch.float32, seed)
    return _fp8(kc * amplitude), _fp8(vc * amplitude), tables


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norms", [False, True])
def test_rotary_write_kv_writes_the_model_dtype_values_rounded_to_e4m3(dtype, norms):
    """K and V bytes equal the model-dtype cache's values (the same kernel, compiled without MII_KV_FP8) cast to
    e4m3; q_out is unchanged by the cache's dtype; slots not written keep their bytes."""
    from mii_async.workers.model.rope import cos_sin_cache, inv_frequencies

    if norms and dtype == torch.float32:
        pytest.skip("the fused head norms take 16-bit types")
    t, hq, hkv, d, nb, bs = 37, 32, 8, 128, 64, 16
    cos_sin = cos_sin_cache(inv_frequencies(d, 500000.0, None), 32768, torch.device("cuda"))
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, device="cuda") * 40).to(dtype)     # some past ±448
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], -1))
    positions = torch.randint(0, 32768, (t,), device="cuda")
    slots = torch.randperm(nb * bs, device="cuda")[:t]
    qk_norm = (torch.rand(d, device="cuda").to(dtype) + 0.5, torch.rand(d, device="cuda").to(dtype) + 0.5,
               1e-6) if norms else None
    wide = [torch.zeros(nb, bs, hkv, d, device="cuda", dtype=dtype) for _ in range(2)]
    q_wide = K.rotary_write_kv(positions, q, k, v, cos_sin, *wide, slots, qk_norm)
    narrow = [torch.full((nb, bs, hkv, d), 0x5a, device="cuda", dtype=torch.uint8).view(FP8_KV) for _ in range(2)]
    q_narrow = K.rotary_write_kv(positions, q, k, v, cos_sin, *narrow, slots, qk_norm)
    assert torch.equal(q_narrow, q_wide)
    flat = slots.tolist()
    written = torch.zeros(nb * bs, dtype=torch.bool, device="cuda")
    written[flat] = True
    for w, n in zip(wide, narrow):
        got = n.view(torch.uint8).view(-1, hkv, d)
        assert torch.equal(got[flat], _fp8(w.view(-1, hkv, d)[flat]).view(torch.uint8))
        assert (got[~written] == 0x5a).all()


# The 16-bit kernels' cases (contexts 1 … 32k, GQA 1 … 16, head dims 64 … 256, block sizes 16 and 32), and G = 12
# across mma's tiles and rings.
DECODE_CASES = CUDA_DECODE_CASES + [
    ([1, 15, 16, 17, 63, 64, 65, 200, 511, 777, 2049, 5000], 48, 4, 128, 16),
]


@pytest.mark.parametrize("kernel", ["mma", "mma/2", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_over_an_fp8_cache(dtype, case, kernel):
    """Each decode kernel over e4m3 K/V against the reference over the same bytes widened to fp32: contexts
    1 … 32k, GQA 1 … 16, head dims 64 … 256, block sizes 16 and 32 (mma takes head dim 128 in 16-bit types;
    other shapes give way to split)."""
    kernel, _, warps = kernel.partition("/")
    clens, hq, hkv, d, bs = DECODE_CASES[case]
    kc, vc, tables = _fp8_paged(clens, hkv, d, bs, seed=case)
    q = torch.randn(len(clens), hq, d, device="cuda").to(dtype)
    meta = _meta([1] * len(clens), clens, tables)
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, d ** -0.5)
    poison()
    out = K.paged_attention_decode(q, kc, vc, meta.block_tables, meta.context_lens, max(clens), d ** -0.5,
                                   kernel=kernel, warps=int(warps) if warps else None)
    assert rel(out, ref) < TOL[dtype], (clens[:4], hq, hkv, d)


@pytest.mark.parametrize("kernel", ["mma", "split"])
def test_fp8_decode_windows_softcaps_partitions_and_grid_orders(kernel):
    """Windows and soft-caps, every split length, and both grid orders (bit for bit the same) over e4m3."""
    clens = [1, 31, 300, 513, 1024, 2500, 77]
    kc, vc, tables = _fp8_paged(clens, 8, 128, 16, seed=11)
    q = torch.randn(len(clens), 32, 128, device="cuda").to(torch.bfloat16)
    meta = _meta([1] * len(clens), clens, tables)
    for window, softcap in ((None, None), (200, None), (None, 30.0), (64, 20.0)):
        ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 128 ** -0.5, window=window,
                                softcap=softcap)
        for partition in (None, *DA.PARTITIONS):
            outs = []
            for grid in DA.GRID_ORDERS:
                poison()
                outs.append(K.paged_attention_decode(q, kc, vc, meta.block_tables, meta.context_lens, max(clens),
                                                     128 ** -0.5, partition=partition, kernel=kernel, grid=grid,
                                                     window=window, softcap=softcap))
                assert rel(outs[-1], ref) < TOL[torch.bfloat16], (window, softcap, partition, grid)
            assert torch.equal(outs[0], outs[1])


def test_stream_gives_way_to_split_over_fp8():
    """The streamed kernel reads 16-bit caches only: asked for it over e4m3, the split kernel answers."""
    clens = [40, 900, 3000]
    kc, vc, tables = _fp8_paged(clens, 8, 128, 16, seed=12)
    q = torch.randn(len(clens), 32, 128, device="cuda").to(torch.bfloat16)
    meta = _meta([1] * len(clens), clens, tables)
    args = (q, kc, vc, meta.block_tables, meta.context_lens, max(clens), 128 ** -0.5)
    assert torch.equal(K.paged_attention_decode(*args, kernel="stream"), K.paged_attention_decode(*args, kernel="split"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prompt_chunks_and_decodes_over_an_fp8_cache(dtype):
    """A SplitFuse step through the op set (decodes, then chunks over earlier chunks through the ragged flash
    path, a windowed layer, a soft-capped one) against the reference over the widened bytes."""
    import numpy as np

    from mii_async.kernels.metadata import device_groups, prefill_layout

    qlens, clens = [1, 1, 1, 40, 7, 300], [900, 5, 64, 40, 77, 1300]
    kc, vc, tables = _fp8_paged(clens, 8, 128, 16, seed=13)
    q = torch.randn(sum(qlens), 32, 128, device="cuda").to(dtype)
    meta = _meta(qlens, clens, tables)
    layout, groups = prefill_layout(tables.cpu().numpy().astype(np.int64), qlens, clens, meta.num_decodes, 16)
    meta = meta._replace(prefill_groups=device_groups(torch.from_numpy(layout).cuda(), groups))
    for window, softcap in ((None, None), (100, None), (None, 50.0)):
        ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 128 ** -0.5, window=window,
                                softcap=softcap)
        poison()
        out = K.paged_attention(q, kc, vc, meta, 128 ** -0.5, window=window, softcap=softcap)
        assert rel(out, ref) < TOL[dtype], (window, softcap)


def test_fp8_decode_replays_in_a_cuda_graph():
    """The rotary write and the decode kernels over e4m3, captured once and replayed over new inputs, give what
    they give eagerly."""
    from mii_async.workers.model.rope import cos_sin_cache, inv_frequencies

    clens = [100, 700, 2049]
    kc, vc, tables = _fp8_paged(clens, 8, 128, 16, seed=14)
    meta = _meta([1] * len(clens), clens, tables)
    cos_sin = cos_sin_cache(inv_frequencies(128, 500000.0, None), 4096, torch.device("cuda"))
    q, k, v = (torch.randn(3, h, 128, device="cuda").to(torch.bfloat16) for h in (32, 8, 8))
    positions = meta.context_lens - 1
    slots = torch.stack([tables[i, (c - 1) // 16] * 16 + (c - 1) % 16 for i, c in enumerate(clens)])

    def step():
        qr = K.rotary_write_kv(positions, q, k, v, cos_sin, kc, vc, slots)
        return K.paged_attention(qr, kc, vc, meta, 128 ** -0.5, config=KernelConfig())

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


def test_default_model_with_an_fp8_cache_answers_paris():
    """kv_cache_dtype="fp8" on the default model (bf16, CUDA kernels, graphs on): the chat answer to the capital
    question is still the bf16 cache's. A GPU machine without the default model's package skips it."""
    import mii_async
    from mii_async.config import default_cache_dir
    from mii_async.errors import ModelNotFoundError
    from mii_async.model_source import resolve_model

    try:
        default_model_dir = resolve_model(None, default_cache_dir())
    except ModelNotFoundError as exc:
        pytest.skip(f"the default model is not installed here: {exc}")
    with mii_async.pipeline(str(default_model_dir), kv_cache_dtype="fp8", device="cuda") as pipe:
        assert pipe._engine.engine.runner.kv_caches[0][0].dtype == FP8_KV
        r = pipe.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=32)
    assert r.generated_text == "The capital of France is Paris."
