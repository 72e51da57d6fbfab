"""The CPU decode attention (kernels/cpu_decode_attention.py, paged_attention's decode rows on the CPU) against a
slow fp64 oracle and against the padded-gather path the GPU reference keeps: GQA ratios, block sizes, ragged
contexts, sliding windows, soft-caps, fp32 and bf16, and block tables in runs, scattered, or shared."""
from __future__ import annotations

import random

import pytest
import torch

from mii_async.kernels import cpu_decode_attention as cda
from mii_async.kernels import reference as ops
from mii_async.kernels.metadata import AttentionMetadata


def _oracle(q, kc, vc, tables, clens, scale, window, softcap):
    """Each decode row's attention, one row at a time in fp64: its blocks looked up one by one, keys before the
    window dropped, scores · scale, soft-capped, softmax, · V. q [S, Hq, D] → [S, Hq, D] fp64."""
    hq, hkv = q.shape[1], kc.shape[2]
    bs = kc.shape[1]
    out = []
    for s, clen in enumerate(clens):
        k = torch.cat([kc[b] for b in tables[s]])[:clen].double()          # [C, Hkv, D]
        v = torch.cat([vc[b] for b in tables[s]])[:clen].double()
        lo = max(0, clen - window) if window is not None else 0
        k, v = k[lo:].repeat_interleave(hq // hkv, 1), v[lo:].repeat_interleave(hq // hkv, 1)
        scores = torch.einsum("hd,khd->hk", q[s].double(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
        assert len(tables[s]) == -(-clen // bs)
    return torch.stack(out)


def _tables(layout: str, clens: list[int], bs: int, rng: random.Random) -> tuple[list[list[int]], int]:
    """Block tables for the contexts, as the block manager could hand them out: `runs` (each row's blocks
    consecutive), `scattered` (every block anywhere), `decoded` (a prompt's run, then single blocks interleaved
    with the other rows', as concurrent decodes take them), `shared` (rows sharing a cached prefix's blocks).
    Returns the tables and the pool's block count."""
    need = [-(-c // bs) for c in clens]
    if layout == "runs":
        at, tables = 1, []
        for n in need:
            tables.append(list(range(at, at + n)))
            at += n + rng.randrange(3)
        return tables, at + 1
    if layout == "scattered":
        pool = list(range(sum(need) + 5))
        rng.shuffle(pool)
        return [[pool.pop() for _ in range(n)] for n in need], sum(need) + 5
    if layout == "decoded":
        at, tables = 0, []
        for n in need:
            p = min(n, 3)
            tables.append(list(range(at, at + p)))
            at += p
        for j in range(max(need)):
            for t, n in zip(tables, need):
                if len(t) < n and j >= 3:
                    t.append(at)
                    at += 1
        return tables, at + 1
    assert layout == "shared"
    prefix = list(range(2))                 # two blocks every long enough row starts with
    at, tables = 2, []
    for n in need:
        own = list(range(at, at + max(0, n - 2)))
        at += len(own) + 1
        tables.append((prefix + own)[:n])
    return tables, at + 1


def _case(hq, hkv, d, bs, clens, layout, dtype, seed=0):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = _tables(layout, clens, bs, rng)
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    q = (torch.randn(len(clens), hq, d, generator=g) * 2).to(dtype)      # large scores: the cap bites
    width = max(len(t) for t in tables)
    n = len(clens)
    meta = AttentionMetadata(torch.zeros(n, dtype=torch.int64),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(clens),
                             torch.arange(n + 1), n, max(clens), [1] * n, clens)
    return q, kc, vc, meta, tables


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# Short rows (the group, when in several runs) and long ones (runs in place and a copy), ragged.
CONTEXTS = {16: [1, 16, 17, 31, 32, 48, 100, 5, 64, 2, 300, 520], 32: [1, 32, 33, 64, 95, 96, 200, 7, 128, 3, 300, 610]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (None, 5.0), (20, None), (45, 3.0), (1000, None)])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2)])
def test_decode_rows_match_the_oracle(hq, hkv, bs, window, softcap, dtype):
    """Ragged contexts (1 key, exact block multiples, one past them), windows shorter and longer than the
    contexts, with and without a soft-cap, in every table layout: fp32 within 1e-6 of an fp64 row-by-row oracle
    and within 2e-6 of the padded-gather path (two fp32 roundings of one value), bf16 within 1e-2 of both."""
    clens = CONTEXTS[bs]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for layout in ("runs", "scattered", "decoded", "shared"):
        q, kc, vc, meta, tables = _case(hq, hkv, 16, bs, clens, layout, dtype, seed=hq + bs)
        out = ops.paged_attention(q, kc, vc, meta, 16 ** -0.5, window=window, softcap=softcap)
        assert out.dtype == dtype
        expected = _oracle(q, kc, vc, tables, clens, 16 ** -0.5, window, softcap)
        assert _rel(out, expected) <= tol, layout
        padded = torch.empty_like(q)
        ops._padded_decode_attention(q, kc, vc, meta, 16 ** -0.5, padded, window, softcap)
        assert _rel(out, padded) <= 2 * tol if dtype == torch.float32 else tol, layout


def test_consecutive_blocks_are_read_in_place():
    """Rows whose attended blocks are consecutive ids get one run each, read from the cache: nothing is
    copied. A window that starts mid-block starts the run at its first key."""
    tables = torch.tensor([[4, 5, 6, 0], [9, 10, 11, 12], [2, 0, 0, 0]])
    plan = cda.plan_decodes(tables, [40, 64, 3], 16, None)
    assert plan.copy_blocks is None
    assert plan.rows == [(cda.Run(False, 64, 40),), (cda.Run(False, 144, 64),), (cda.Run(False, 32, 3),)]
    plan = cda.plan_decodes(tables, [40, 64, 3], 16, 10)
    assert plan.rows == [(cda.Run(False, 64 + 30, 10),), (cda.Run(False, 144 + 54, 10),), (cda.Run(False, 32, 3),)]


def test_long_rows_read_long_runs_in_place_and_copy_short_ones_together():
    """A long row with a long run and single blocks reads the run in place and its single blocks from one copy
    that every row's short runs share, in table order (a lone short row in several runs too); blocks outside the
    window are neither read nor copied."""
    run = list(range(100, 118))                                  # 18 blocks: keys 0 … 287
    tables = torch.tensor([run + [9, 20], [7, 30] + list(range(40, 58))])
    plan = cda.plan_decodes(tables, [315, 20], 16, None)
    assert plan.group is None and plan.copy_blocks.tolist() == [9, 20, 7, 30]
    assert plan.rows[0] == (cda.Run(False, 1600, 288), cda.Run(True, 0, 27))
    assert plan.rows[1] == (cda.Run(True, 32, 20),)
    plan = cda.plan_decodes(tables, [315, 20], 16, 300)          # keys 15 … 314: the run from key 15 on
    assert plan.rows[0] == (cda.Run(False, 1615, 273), cda.Run(True, 0, 27))
    plan = cda.plan_decodes(tables, [315, 300], 16, 20)          # keys 295 … 314: blocks 9 and 20 only
    assert plan.copy_blocks.tolist() == [9, 20]
    assert plan.rows[0] == (cda.Run(True, 7, 20),)


def test_short_rows_in_several_runs_attend_as_one_group():
    """Two or more short rows in several runs are gathered whole, padded to the most blocks with block 0, and
    masked by a bias of 0 at their attended keys and -inf elsewhere; a row in one run stays in place."""
    tables = torch.tensor([[3, 4, 9, 0], [7, 30, 31, 12], [5, 6, 0, 0]])
    plan = cda.plan_decodes(tables, [40, 60, 20], 16, None)
    assert plan.copy_blocks is None and plan.rows == [(), (), (cda.Run(False, 80, 20),)]
    assert plan.group.rows.tolist() == [0, 1]
    assert plan.group.blocks.tolist() == [3, 4, 9, 0, 7, 30, 31, 12]
    seen = plan.group.bias[:, 0] == 0
    assert seen[0, :40].all() and not seen[0, 40:].any() and seen[1, :60].all() and not seen[1, 60:].any()
    assert (plan.group.bias[~(plan.group.bias == 0)] == float("-inf")).all()
    plan = cda.plan_decodes(tables, [40, 60, 20], 16, 30)        # row 1 from key 30: blocks 30, 31, 12
    assert plan.group.blocks.tolist() == [3, 4, 9, 30, 31, 12]
    assert (plan.group.bias[1, 0] == 0).tolist() == [False] * 14 + [True] * 30 + [False] * 4
    tables = torch.cat([tables, torch.arange(40, 60).expand(3, 20)], 1)
    plan = cda.plan_decodes(tables[:2], [40, 300], 16, None)     # one short row left: it attends in runs
    assert plan.group is None and plan.rows[0] == (cda.Run(False, 48, 32), cda.Run(True, 0, 8))


def test_the_plan_is_built_once_per_step_and_window():
    """Every layer of a step shares its metadata: the decode plan is made by the first call for a window and
    reused by the next; a layer with another window gets its own."""
    q, kc, vc, meta, _ = _case(9, 3, 16, 16, [5, 40, 17], "decoded", torch.float32)
    a = ops.paged_attention(q, kc, vc, meta, 0.25)
    plans = dict(meta.memo)
    assert len(plans) == 1
    b = ops.paged_attention(q, kc, vc, meta, 0.25)
    assert torch.equal(a, b) and all(meta.memo[k] is v for k, v in plans.items())
    ops.paged_attention(q, kc, vc, meta, 0.25, window=8)
    assert len(meta.memo) == 2
    assert not meta._replace(num_decodes=2).memo


def test_decodes_beside_prompt_chunks_and_into_a_strided_out():
    """A step of decodes and a prompt chunk: the decode rows (in runs, or as the group) as the oracle has them,
    the chunk's rows as the dense reference does, and both written into a given `out` that is a strided view."""
    hq, hkv, d, bs = 8, 2, 16, 16
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(20, bs, hkv, d, generator=g), torch.randn(20, bs, hkv, d, generator=g)
    tables = [[1, 2, 3], [7], [10, 11]]
    clens, qlens = [40, 9, 30], [1, 1, 5]
    q = torch.randn(7, hq, d, generator=g)
    meta = AttentionMetadata(torch.zeros(7, dtype=torch.int64),
                             torch.tensor([t + [0] * (3 - len(t)) for t in tables]), torch.tensor(clens),
                             torch.tensor([0, 1, 2, 7]), 2, 40, qlens, clens)
    store = torch.zeros(7, hq, 2 * d)
    out = store[:, :, :d]                                        # not contiguous
    ops.paged_attention(q, kc, vc, meta, d ** -0.5, out=out)
    assert _rel(out[:2], _oracle(q, kc, vc, tables, clens[:2], d ** -0.5, None, None)) <= 1e-6
    chunk = torch.empty_like(q)
    ops.prefill_attention(q, kc, vc, meta, d ** -0.5, chunk)
    assert torch.equal(out[2:], chunk[2:])
    assert not store[:, :, d:].any()
    tables = [[1, 5, 3], [7, 9]]                                 # both decodes short, in several runs: the group
    meta = meta._replace(block_tables=torch.tensor([t + [0] * (3 - len(t)) for t in tables] + [[10, 11, 0]]),
                         context_lens=torch.tensor([40, 20, 30]), context_lens_host=[40, 20, 30])
    store.zero_()
    ops.paged_attention(q, kc, vc, meta, d ** -0.5, out=out)
    assert next(iter(meta.memo.values())).group.rows.tolist() == [0, 1]
    assert _rel(out[:2], _oracle(q, kc, vc, tables, [40, 20], d ** -0.5, None, None)) <= 1e-6
    assert not store[:, :, d:].any()
