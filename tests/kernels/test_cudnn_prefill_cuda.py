"""Prompt attention through cuDNN (kernels/cudnn_prefill.py, nvidia-cudnn-frontend) against the reference:
the step shapes of the flash path's tests, one-token chunks and prefixes, a long prompt's last chunk, and one
graph serving every step of its bucket."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("cupy")
pytest.importorskip("cudnn")

from mii_async.kernels import cuda as K  # noqa: E402
from mii_async.kernels import cudnn_prefill as C  # noqa: E402
from mii_async.kernels import reference as R  # noqa: E402
from mii_async.kernels.config import KernelConfig  # noqa: E402

from .test_cuda_kernels import PREFILL_CASES, TOL, _meta, _paged, poison, rel  # noqa: E402

CUDNN_CASES = [c[:6] for c in PREFILL_CASES] + [   # (query lengths, context lengths, Hq, Hkv, D, block size)
    ([1, 1, 5, 1], [1, 2, 6, 300], 32, 8, 128, 32),       # one-token chunks and prefixes, block size 32
    ([2048], [30000], 32, 8, 128, 16),                    # the last chunk of a long prompt
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CUDNN_CASES)))
def test_cudnn_prefill_attention(dtype, case):
    """prefill_attention="cudnn": the chunks through cuDNN's fused attention over the paged cache in place
    (bottom-right causal per sequence, GQA native), called directly and through the op; against the reference,
    the decodes before the chunks included. The rows before the chunks are not written by the cuDNN call."""
    qlens, clens, hq, hkv, d, bs = CUDNN_CASES[case]
    kc, vc, tables = _paged(clens, hkv, d, bs, dtype, seed=200 + case)
    q = torch.randn(sum(qlens), hq, d, device="cuda").to(dtype)
    meta = _meta(qlens, clens, tables)
    ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, d ** -0.5)
    assert C.supported(q, kc, None, None)
    out = torch.full_like(q, float("nan"))
    C.prefill(q, kc, vc, meta, d ** -0.5, out)
    nd = meta.num_decodes
    assert out[:nd].isnan().all() and rel(out[nd:], ref[nd:]) < TOL[dtype], case
    poison()
    out = K.paged_attention(q, kc, vc, meta, d ** -0.5, config=KernelConfig(prefill_attention="cudnn"))
    assert rel(out, ref) < TOL[dtype], case


def test_cudnn_prefill_reuses_its_graph_across_steps():
    """Steps of other lengths in the same bucket (sequences, longest chunk, longest context, each to a power of
    four) run the graph built for the first, over one cache as an engine's; each gives the reference's answer;
    a longer chunk builds one more."""
    C._graphs.clear()
    g = torch.Generator(device="cuda").manual_seed(5)
    kc, vc = (torch.randn(400, 16, 8, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    for qlens, clens in (([100, 30], [900, 30]), ([128, 7], [128, 1000]), ([64, 1], [3000, 2]),
                         ([400, 3], [400, 3000])):
        perm = torch.randperm(400, device="cuda", generator=g)
        need = [-(-c // 16) for c in clens]
        tables = torch.zeros(len(clens), max(need), dtype=torch.int64, device="cuda")
        at = 0
        for i, n in enumerate(need):
            tables[i, :n] = perm[at:at + n]
            at += n
        q = torch.randn(sum(qlens), 32, 128, device="cuda", generator=g).bfloat16()
        meta = _meta(qlens, clens, tables)
        ref = R.paged_attention(q.float(), kc.float(), vc.float(), meta, 128 ** -0.5)
        out = torch.empty_like(q)
        C.prefill(q, kc, vc, meta, 128 ** -0.5, out)
        assert rel(out[meta.num_decodes:], ref[meta.num_decodes:]) < TOL[torch.bfloat16], qlens
    assert len(C._graphs) == 2, list(C._graphs)
