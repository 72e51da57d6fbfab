"""The op set's torch reference against dense attention and against transformers' own layers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mii_async.kernels import reference as ops
from mii_async.kernels.metadata import AttentionMetadata


def _paged_setup(seq_specs, hq, hkv, d, bs, num_blocks, seed=0):
    """seq_specs: (query_len, context_len) per sequence, decodes first. Returns inputs and a dense oracle."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, qs, expected = [], [], []
    for qlen, clen in seq_specs:
        nb = -(-clen // bs)
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks)
        q = torch.randn(qlen, hq, d, generator=g)
        qs.append(q)
        k = k_cache[blocks].flatten(0, 1)[:clen].repeat_interleave(hq // hkv, 1)   # [C, Hq, D]
        v = v_cache[blocks].flatten(0, 1)[:clen].repeat_interleave(hq // hkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        qpos = torch.arange(clen - qlen, clen)
        scores = scores.masked_fill(torch.arange(clen)[None, None, :] > qpos[None, :, None], float("-inf"))
        expected.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    width = max(len(t) for t in tables)
    qlens = [s[0] for s in seq_specs]
    clens = [s[1] for s in seq_specs]
    meta = AttentionMetadata(torch.zeros(sum(qlens), dtype=torch.int64),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             torch.tensor(clens), torch.tensor([0] + list(torch.tensor(qlens).cumsum(0))),
                             sum(1 for q in qlens if q == 1), max(clens), qlens, clens)
    return torch.cat(qs), k_cache, v_cache, meta, torch.cat(expected)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (9, 3)])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_paged_attention_matches_dense(hq, hkv, bs):
    """Ragged batch of decodes, a fresh prefill and chunks with history: equals dense causal attention."""
    specs = [(1, 1), (1, 37), (1, 5), (20, 20), (7, 50), (3, 3 + bs)]
    q, kc, vc, meta, expected = _paged_setup(specs, hq, hkv, 32, bs, num_blocks=200)
    out = ops.paged_attention(q, kc, vc, meta, 32 ** -0.5)
    assert torch.linalg.norm(out - expected) / torch.linalg.norm(expected) < 1e-5


def test_write_kv_places_tokens_at_slots():
    """write_kv puts token i's K/V at slot_mapping[i] and touches nothing else."""
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([13, 2, 7])
    ops.write_kv(k, v, kc, vc, slots)
    flat = kc.view(16, 2, 8)
    assert torch.equal(flat[slots], k) and torch.equal(vc.view(16, 2, 8)[slots], v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[untouched].any() and not vc.view(16, 2, 8)[untouched].any()


def test_norms_and_activation_match_transformers():
    """rms_norm / fused_add_rms_norm equal LlamaRMSNorm; silu_and_mul equals the Llama MLP's activation."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, r = torch.randn(5, 64), torch.randn(5, 64)
    norm = LlamaRMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    with torch.no_grad():
        assert torch.allclose(ops.rms_norm(x, norm.weight, 1e-5), norm(x))
        out, res = ops.fused_add_rms_norm(x, r, norm.weight, 1e-5)
        assert torch.allclose(res, x + r) and torch.allclose(out, norm(x + r))
    gu = torch.randn(5, 32)
    assert torch.allclose(ops.silu_and_mul(gu), F.silu(gu[:, :16]) * gu[:, 16:])


def test_rotary_matches_transformers():
    """rotary_embedding equals transformers' apply_rotary_pos_emb with Llama-3 scaled frequencies."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from mii_async.workers.model.rope import cos_sin_cache, inv_frequencies

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, rope_scaling=scaling, rope_theta=500000.0,
                      max_position_embeddings=512)
    rope = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([0, 3, 100, 511])
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    cos, sin = rope(q, pos[None])
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    table = cos_sin_cache(inv_frequencies(64, 500000.0, scaling), 512, torch.device("cpu"))
    oq, ok = ops.rotary_embedding(pos, q, k, table)
    assert torch.allclose(oq, rq[0].transpose(0, 1), atol=1e-5) and torch.allclose(ok, rk[0].transpose(0, 1), atol=1e-5)
