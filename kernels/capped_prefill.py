"""Soft-capped attention of a step's prompt chunks, batched (Gemma 2).

Neither torch's flash attention nor SDPA soft-caps scores, so capped prompt chunks go through the reference's
masked fp32 attention (reference._attend, transformers' eager order). Per sequence, that is a dozen launches a
layer for each of a step's chunks: an offline step of sixteen 128-token prompts makes hundreds a layer. Here the
chunks are padded to one [S, L, C] batch (queries to the longest chunk, keys to the longest context) and
attended in one call; a padded query row attends key 0 only and is dropped. Where padding would more than
double the scores computed, the caller loops per sequence instead.
"""
from __future__ import annotations

import torch

from .kv_store import select_blocks
from .metadata import AttentionMetadata

PADDING_LIMIT = 2.0     # padded scores over the chunks' own, beyond which the batch is not worth it


def worth_batching(meta: AttentionMetadata) -> bool:
    """Whether the step's prompt chunks (from num_decodes on) are several and pad to at most PADDING_LIMIT times
    their own scores."""
    lens = meta.query_lens[meta.num_decodes:]
    ctx = meta.context_lens_host[meta.num_decodes:len(meta.query_lens)]
    if len(lens) < 2:
        return False
    own = sum(q * c for q, c in zip(lens, ctx))
    return len(lens) * max(lens) * max(ctx) <= PADDING_LIMIT * own


def capped_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, out: torch.Tensor, window: int | None, softcap: float, attend) -> None:
    """The prompt chunks' rows of q [T, Hq, D] (from num_decodes on) attended over their cached K/V with
    `softcap` (and `window`), batched, into `out`. `attend` is reference._attend."""
    first, n = meta.num_decodes, len(meta.query_lens)
    lens, ctx = meta.query_lens[first:n], meta.context_lens_host[first:n]
    s, lmax, cmax = len(lens), max(lens), max(ctx)
    bs = k_cache.shape[1]
    nb = -(-cmax // bs)
    hq, d = q.shape[1], q.shape[2]
    start = sum(meta.query_lens[:first])
    rows = [i * lmax + j for i, qlen in enumerate(lens) for j in range(qlen)]          # padded row of each
    rows_t = torch.tensor(rows, device=q.device)
    qp = q.new_zeros(s * lmax, hq, d).index_copy_(0, rows_t, q[start:start + len(rows)])
    tables = meta.block_tables[first:n, :nb]

    def gather(cache: torch.Tensor) -> torch.Tensor:            # [S, Hkv, nb·bs, D]
        blocks = select_blocks(cache, tables.reshape(-1))
        return blocks.view(s, nb * bs, *cache.shape[2:]).transpose(1, 2).to(q.dtype)

    keys, vals = gather(k_cache), gather(v_cache)
    # Query j of sequence i sits at position ctx_i - len_i + j; padded rows at position 0 (key 0 only).
    qpos = torch.tensor([[c - ql + j if j < ql else 0 for j in range(lmax)] for ql, c in zip(lens, ctx)],
                        device=q.device)[:, :, None]                               # [S, L, 1]
    kpos = torch.arange(nb * bs, device=q.device)[None, None, :]                   # [1, 1, C]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    o = attend(qp.view(s, lmax, hq, d).transpose(1, 2), keys, vals, mask[:, None], scale, softcap)  # [S, Hq, L, D]
    out[start:start + len(rows)] = o.transpose(1, 2).reshape(s * lmax, hq, d).index_select(0, rows_t)
