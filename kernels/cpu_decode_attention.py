"""Decode attention on the CPU: each one-token query row attends its own keys, read where they lie in the paged
cache.

On the CPU the decode step is bound by memory bandwidth, and copying K/V out of the cache (a gather) costs more
than reading it: the copy writes as many bytes as it reads, and the attention reads them again. So a sequence
attends its keys in place, per run of consecutive block ids (a prompt's blocks come as one run), with one batched
matmul per run: q viewed as [Hkv, G, D] against K [Hkv, D, C] as a strided view of the cache, so GQA never
expands K/V, no key beyond the context or outside the window is touched, and no mask is needed. Blocks in runs
shorter than MIN_RUN would cost more in per-run calls than they save: they are copied, for every sequence of the
step at once, by one index_select per layer, and each sequence attends its copied blocks as one more run. Keys of
one sequence may so be attended out of order: attention does not depend on the keys' order.

A short sequence (at most SHORT_KEYS keys) in several runs, as every sequence is once concurrent decodes have
taken single blocks after its prompt's run, costs more in its per-run calls than its keys cost to copy: such rows
are gathered whole, padded to the longest of them, and attend as one group (a few large calls per layer, the
mask an additive bias made once per step), still without expanding K/V.

What depends on the step only (the runs, the copy's block ids, the group and its bias) is `DecodePlan`, built once
per step and window on the host and shared by every layer. Scores and softmax are fp32 whatever the cache's dtype
(bf16 K/V are widened), as torch's SDPA computes them.

The rows' kernels are small (microseconds each) and torch opens an OpenMP parallel region for each bmm and
softmax whatever its size: three or more per row and layer, each a fork and join that costs more than the kernel
when the pool's threads sleep between regions (a passive wait policy) or share their cores with other processes
(measured: 0.07–0.1x the padded path at batch 16 with 2 threads on a loaded 2-core machine). So the row loop runs
on the calling thread alone, the caller's thread count restored after it; the copies, the group and the scaling of q,
a few large kernels per layer, keep the caller's threads.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .kv_store import select_blocks

MIN_RUN = 2         # blocks: a shorter run of consecutive block ids is copied with the step's other short runs
SHORT_KEYS = 256    # keys: a row in several runs with at most these many attends in the step's gathered group


class Run(NamedTuple):
    copied: bool        # the keys lie in the step's copy of short runs, not in the cache itself
    start: int          # first key's flat slot: in the cache (block * block_size + offset), or in the copy
    length: int         # keys


class Group(NamedTuple):
    """Rows attending together over their blocks gathered and padded to the longest: [n, L = blocks * bs]."""
    rows: torch.Tensor      # [n] int64: the rows of q / out
    blocks: torch.Tensor    # [n * blocks] int64: each row's block ids from its first attended one, padded with 0
    bias: torch.Tensor      # [n, 1, L] fp32: 0 at the row's attended keys, -inf at the others


class DecodePlan(NamedTuple):
    rows: list[tuple[Run, ...]]         # per decode row, its keys as runs (at most one copied); () in the group
    copy_blocks: torch.Tensor | None    # [B] int64: the block ids the copy holds, in order; None: nothing copied
    group: Group | None                 # the short rows in several runs; None: none (or only one)


def plan_decodes(block_tables: torch.Tensor, context_lens: list[int], block_size: int,
                 window: int | None) -> DecodePlan:
    """The runs each decode row attends. block_tables [S, W] (the first S = len(context_lens) rows: decodes),
    context_lens: keys per decode after this step's write. With a sliding `window`, a row's keys are its last
    `window`, as paged_attention defines it. Vectorised over every block of every row (numpy): one step's plan,
    however scattered its blocks, costs tens of microseconds."""
    n, bs = len(context_lens), block_size
    tables = block_tables[:n].cpu().numpy()
    clens = np.asarray(context_lens, np.int64)
    lo = np.maximum(clens - window, 0) if window is not None else np.zeros(n, np.int64)
    b0 = lo // bs
    count = (clens - 1) // bs + 1 - b0                      # blocks per row: [b0, b0 + count)
    row = np.repeat(np.arange(n), count)                    # [B] each attended block's row, row after row
    first = np.repeat(np.cumsum(count) - count, count)      # index of the row's first block in [B]
    col = np.arange(len(row)) - first + b0[row]             # the block's column in its row's table
    ids = tables[row, col]
    keys = np.minimum(clens[row], (col + 1) * bs) - np.maximum(lo[row], col * bs)   # [B] keys each block holds
    skip = np.maximum(lo[row], col * bs) - col * bs         # [B] keys before the row's first one (first block)
    opens = np.ones(len(row), bool)                         # the block starts a run of consecutive ids
    opens[1:] = (ids[1:] != ids[:-1] + 1) | (row[1:] != row[:-1])
    run = np.cumsum(opens) - 1                              # [B] its run
    run_blocks = np.bincount(run)
    one_run = np.bincount(row[opens], minlength=n) == 1
    grouped = ~one_run & (clens - lo <= SHORT_KEYS)
    if grouped.sum() < 2:                                   # a lone short row attends in runs
        grouped[:] = False
    in_place = ((run_blocks[run] >= MIN_RUN) | one_run[row]) & ~grouped[row]
    starts = np.flatnonzero(opens & in_place)               # first block of each run read in place
    run_keys = np.bincount(run, weights=keys).astype(np.int64)
    rows: list[list[Run]] = [[] for _ in range(n)]
    for r, a, c in zip(row[starts].tolist(), (ids[starts] * bs + skip[starts]).tolist(),
                       run_keys[run[starts]].tolist()):
        rows[r].append(Run(False, a, c))
    copy = None
    moved = np.flatnonzero(~in_place & ~grouped[row])
    if len(moved):
        # Only a row's first block starts after its offset 0 and only its last ends before the block does, so
        # a row's short-run blocks, copied in table order, hold its keys contiguously from its first one on.
        opens_copy = np.ones(len(moved), bool)
        opens_copy[1:] = row[moved[1:]] != row[moved[:-1]]
        heads = np.flatnonzero(opens_copy)                  # each row's first copied block, within the copy
        copied_keys = np.bincount(row[moved], weights=keys[moved], minlength=n).astype(np.int64)
        for r, a in zip(row[moved[heads]].tolist(), (heads * bs + skip[moved[heads]]).tolist()):
            rows[r].append(Run(True, a, int(copied_keys[r])))
        copy = torch.from_numpy(ids[moved]).to(block_tables.device)
    members = np.flatnonzero(grouped)
    group = _group(tables, members, b0, count, lo, clens, bs, block_tables.device) if len(members) else None
    return DecodePlan([tuple(r) for r in rows], copy, group)


def _group(tables: np.ndarray, members: np.ndarray, b0: np.ndarray, count: np.ndarray, lo: np.ndarray,
           clens: np.ndarray, bs: int, device: torch.device) -> Group:
    """The group of rows `members`: row r gathers blocks b0[r] … b0[r] + count[r] - 1 of its table, padded to the
    most blocks with block 0 (masked), and attends keys lo[r] … clens[r] - 1 of them."""
    nb = int(count[members].max())
    cols = b0[members, None] + np.arange(nb)                               # [n, nb]
    real = np.arange(nb) < count[members, None]
    blocks = np.where(real, tables[members[:, None], np.minimum(cols, tables.shape[1] - 1)], 0)
    pos = b0[members, None] * bs + np.arange(nb * bs)                      # [n, L] the key each slot holds
    seen = (pos >= lo[members, None]) & (pos < clens[members, None])
    bias = np.where(seen, np.float32(0), np.float32(-np.inf))[:, None, :]
    return Group(torch.from_numpy(members).to(device), torch.from_numpy(blocks.reshape(-1)).to(device),
                 torch.from_numpy(np.ascontiguousarray(bias)).to(device))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                     scale: float, out: torch.Tensor, softcap: float | None = None) -> None:
    """Rows [0, len(plan.rows)) of q [T, Hq, D] attend their keys in the caches [N, bs, Hkv, D] as `plan` lays
    them out (the group's rows together, the others run by run); results are written into the same rows of
    `out` [T, Hq, D]. `softcap`: scores s·scale become softcap·tanh(s·scale / softcap) before the softmax."""
    nd = len(plan.rows)
    if not nd:
        return
    n, bs, hkv, d = k_cache.shape
    hq = q.shape[1]
    g = hq // hkv
    # The caches as key-major [slots, Hkv, D], in place; short runs copied once for every row.
    keys, vals = k_cache.view(n * bs, hkv, d), v_cache.view(n * bs, hkv, d)
    if plan.copy_blocks is not None:
        copy_k = select_blocks(k_cache, plan.copy_blocks).view(-1, hkv, d)
        copy_v = select_blocks(v_cache, plan.copy_blocks).view(-1, hkv, d)
    else:
        copy_k = copy_v = keys
    direct = out.dtype == torch.float32 and out[:nd].is_contiguous()
    res = out[:nd] if direct else torch.empty(nd, hq, d, dtype=torch.float32)
    if plan.group is not None:
        _attend_group(q, k_cache, v_cache, plan.group, scale, softcap, res)
    if any(plan.rows):
        # Without a soft-cap the scale is folded into q once for every row (one multiply, not one per row).
        qs = q[:nd].float() * scale if softcap is None else q[:nd].float()
        q_rows = qs.view(nd, hkv, g, d).unbind(0)          # [Hkv, G, D] each
        out_rows = res.view(nd, hkv, g, d).unbind(0)
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(1)
        try:
            _attend_rows(q_rows, out_rows, plan.rows, keys, vals, copy_k, copy_v, scale, softcap)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)
    if not direct:
        out[:nd] = res


def _attend_rows(q_rows: tuple[torch.Tensor, ...], out_rows: tuple[torch.Tensor, ...], rows: list[tuple[Run, ...]],
                 keys: torch.Tensor, vals: torch.Tensor, copy_k: torch.Tensor, copy_v: torch.Tensor, scale: float,
                 softcap: float | None) -> None:
    """Each row's attention, q_rows[r] [Hkv, G, D] fp32 (scaled already without a soft-cap) into out_rows[r]
    [Hkv, G, D] fp32. keys, vals: the caches as [slots, Hkv, D]; copy_k, copy_v: the copy of short runs."""
    wide = keys.dtype != torch.float32                  # bf16 (or narrower) K/V widened per run
    for qh, o, runs in zip(q_rows, out_rows, rows):
        if not runs:                            # the row is in the group
            continue
        if len(runs) == 1:
            copied, a, c = runs[0]
            k, v = (copy_k, copy_v) if copied else (keys, vals)
            k, v = k[a:a + c], v[a:a + c]                                                # [C, Hkv, D]
            if wide:
                k, v = k.float(), v.float()
            s = torch.bmm(qh, k.permute(1, 2, 0))                                        # [Hkv, G, C]
            if softcap is not None:             # transformers' eager order: · scale, / cap, tanh, · cap
                s.mul_(scale).div_(softcap).tanh_().mul_(softcap)
            torch.bmm(torch.softmax(s, -1), v.permute(1, 0, 2), out=o)
            continue
        ks, vs = [], []
        for copied, a, c in runs:
            k, v = (copy_k, copy_v) if copied else (keys, vals)
            ks.append(k[a:a + c].float() if wide else k[a:a + c])
            vs.append(v[a:a + c].float() if wide else v[a:a + c])
        s = torch.cat([torch.bmm(qh, k.permute(1, 2, 0)) for k in ks], -1)
        if softcap is not None:
            s.mul_(scale).div_(softcap).tanh_().mul_(softcap)
        p = torch.softmax(s, -1)
        at = 0
        for i, v in enumerate(vs):
            c = v.shape[0]
            if i == 0:
                torch.bmm(p[..., :c], v.permute(1, 0, 2), out=o)
            else:
                o.baddbmm_(p[..., at:at + c], v.permute(1, 0, 2))
            at += c


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: Group, scale: float,
                  softcap: float | None, res: torch.Tensor) -> None:
    """The group's rows of q [T, Hq, D] over their gathered blocks, into the same rows of res [nd, Hq, D] fp32.
    Without a soft-cap, one SDPA call (its CPU kernel takes the strided K/V and GQA as they are, and computes in
    fp32; measured against a bmm per KV head, it is as fast on one thread and 2–3x faster on two); with one, per
    KV head one bmm of the rows' G query heads against their keys, the cap, the bias, softmax, one bmm with V."""
    n, bs, hkv, d = k_cache.shape
    rows = group.rows.numel()
    length = group.bias.shape[-1]
    g = q.shape[1] // hkv
    keys = select_blocks(k_cache, group.blocks).view(rows, length, hkv, d)
    vals = select_blocks(v_cache, group.blocks).view(rows, length, hkv, d)
    if softcap is None:
        qg = q.index_select(0, group.rows).unsqueeze(2)                                  # [rows, Hq, 1, D]
        o = F.scaled_dot_product_attention(qg, keys.transpose(1, 2).to(q.dtype), vals.transpose(1, 2).to(q.dtype),
                                           attn_mask=group.bias[:, None].to(q.dtype), scale=scale, enable_gqa=True)
        res.index_copy_(0, group.rows, o.squeeze(2).float())
        return
    if k_cache.dtype != torch.float32:
        keys, vals = keys.float(), vals.float()
    qg = q.index_select(0, group.rows).float().view(rows, hkv, g, d)
    o = torch.empty(hkv, rows, g, d)
    for h in range(hkv):
        s = torch.bmm(qg[:, h], keys[:, :, h].transpose(1, 2))                            # [rows, G, L]
        s.mul_(scale).div_(softcap).tanh_().mul_(softcap)
        s += group.bias
        torch.bmm(torch.softmax(s, -1), vals[:, :, h], out=o[h])
    res.index_copy_(0, group.rows, o.transpose(0, 1).reshape(rows, hkv * g, d))
