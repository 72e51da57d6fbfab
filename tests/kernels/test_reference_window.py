"""The torch reference's paged attention with a sliding window and a logit soft-cap, against dense attention
computed the way transformers computes it (eager: scores · scale, soft-cap, mask, softmax, · V), and GeGLU
against transformers' activation."""
from __future__ import annotations

import pytest
import torch

from mii_async.kernels import reference as ops
from mii_async.kernels.metadata import AttentionMetadata


def _oracle(q, k, v, qlen, clen, scale, window, softcap):
    """q [L, Hq, D], k, v [C, Hkv, D] → [L, Hq, D]: queries at positions C-L … C-1, as transformers masks them
    (key j seen by query i when j ≤ i and j > i - window)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    qpos = torch.arange(clen - qlen, clen)[:, None]
    kpos = torch.arange(clen)[None, :]
    seen = kpos <= qpos
    if window is not None:
        seen &= kpos > qpos - window
    s = s.masked_fill(~seen[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def _setup(specs, hq, hkv, d, bs, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // bs) for _, c in specs) + 2
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, qs = [], []
    for qlen, clen in specs:
        tables.append([perm.pop() for _ in range(-(-clen // bs))])
        qs.append(torch.randn(qlen, hq, d, generator=g) * 3)          # large scores: the cap bites
    width = max(len(t) for t in tables)
    qlens, clens = [s[0] for s in specs], [s[1] for s in specs]
    meta = AttentionMetadata(torch.zeros(sum(qlens), dtype=torch.int64),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(clens),
                             torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist()),
                             sum(1 for n in qlens if n == 1), max(clens), qlens, clens)
    return torch.cat(qs), kc, vc, meta, tables


@pytest.mark.parametrize("window,softcap", [(5, None), (16, None), (1, None), (None, 2.0), (7, 1.5), (200, 50.0)])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_paged_attention_window_and_softcap_match_transformers_masking(window, softcap, bs):
    """Decodes (contexts shorter and longer than the window), a fresh prompt, chunks over earlier chunks and
    a chunk that starts past the window: equal to dense attention with transformers' sliding mask and cap."""
    specs = [(1, 1), (1, 37), (1, 5), (1, 64), (20, 20), (7, 50), (3, 3 + bs), (9, 90)]
    hq, hkv, d = 8, 2, 16
    q, kc, vc, meta, tables = _setup(specs, hq, hkv, d, bs, seed=bs)
    out = ops.paged_attention(q, kc, vc, meta, d ** -0.5, window=window, softcap=softcap)
    start = 0
    for (qlen, clen), blocks in zip(specs, tables):
        k = kc[blocks].flatten(0, 1)[:clen]
        v = vc[blocks].flatten(0, 1)[:clen]
        ref = _oracle(q[start:start + qlen], k, v, qlen, clen, d ** -0.5, window, softcap)
        got = out[start:start + qlen]
        assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) < 1e-5, (qlen, clen)
        start += qlen
    if window is not None and window < 37:                      # the window changes the answer
        dense = ops.paged_attention(q, kc, vc, meta, d ** -0.5, softcap=softcap)
        assert not torch.allclose(dense[1], out[1])


@pytest.mark.parametrize("window", [None, 6, 25])
@pytest.mark.parametrize("bs", [1, 16])
def test_soft_capped_prompt_chunks_batched_match_transformers_masking(window, bs):
    """Prompt chunks of like lengths beside decodes, soft-capped: attended as one padded batch
    (capped_prefill.py), equal to dense attention with transformers' mask and cap for every row; one chunk that
    would pad too much sends the step back to the per-sequence loop, with the same results."""
    from mii_async.kernels import capped_prefill

    hq, hkv, d = 8, 2, 16
    for specs, batched in (([(1, 9), (1, 33), (16, 16), (12, 12), (16, 40), (10, 30)], True),
                           ([(1, 9), (16, 16), (2, 300)], False)):
        q, kc, vc, meta, tables = _setup(specs, hq, hkv, d, bs, seed=len(specs) + bs)
        assert capped_prefill.worth_batching(meta) is batched
        out = ops.paged_attention(q, kc, vc, meta, d ** -0.5, window=window, softcap=2.0)
        start = 0
        for (qlen, clen), blocks in zip(specs, tables):
            k = kc[blocks].flatten(0, 1)[:clen]
            v = vc[blocks].flatten(0, 1)[:clen]
            ref = _oracle(q[start:start + qlen], k, v, qlen, clen, d ** -0.5, window, 2.0)
            got = out[start:start + qlen]
            assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) < 1e-5, (qlen, clen)
            start += qlen


def test_softcap_changes_large_scores_only():
    """A cap far above every score leaves attention as it is; a small one changes it."""
    q, kc, vc, meta, _ = _setup([(1, 30), (12, 40)], 4, 4, 16, 4, seed=1)
    plain = ops.paged_attention(q, kc, vc, meta, 0.25)
    assert torch.allclose(ops.paged_attention(q, kc, vc, meta, 0.25, softcap=1e6), plain, atol=1e-6)
    assert not torch.allclose(ops.paged_attention(q, kc, vc, meta, 0.25, softcap=1.0), plain, atol=1e-3)


def test_gelu_tanh_and_mul_matches_transformers():
    """GeGLU: transformers' gelu_pytorch_tanh on the gate, times up; the fused norm variant equals norm, linear,
    GeGLU."""
    from transformers.activations import ACT2FN

    x = torch.randn(5, 2 * 24) * 3
    gate, up = x.chunk(2, -1)
    assert torch.allclose(ops.gelu_tanh_and_mul(x), ACT2FN["gelu_pytorch_tanh"](gate) * up, atol=1e-6)
    h, res, w, gu = torch.randn(5, 16), torch.randn(5, 16), torch.rand(16) + 0.5, torch.randn(48, 16)
    y, new_res = ops.add_rms_norm_gate_up_gelu(h, res, w, 1e-6, gu)
    normed, ref_res = ops.fused_add_rms_norm(h, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    assert torch.allclose(y, ops.gelu_tanh_and_mul(normed @ gu.T), atol=1e-6)
