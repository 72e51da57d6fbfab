"""Prompt-chunk attention on the GPU: the rows of a step from num_decodes on, over the paged KV cache, for the
CUDA op set (cuda.paged_attention).

In bf16 / fp16, every chunk of a group in one call of torch's variable-length flash attention: its keys and
values are gathered from the blocked cache with one index each (`meta.prefill_groups`), GQA is native, a chunk's
causal mask is aligned to the end of its context (a chunk over earlier chunks sees all of them), and a sliding
window is flash's left window. Scores stay in fp32. The gather takes a group's whole contexts, window or not:
the key layout is the step's, one for every layer. Other dtypes, or a torch without flash attention, go one
sequence at a time through SDPA's fused kernels (`_prefill_per_sequence`), as does a window where this torch's
flash forward takes none; soft-capped attention (Gemma 2), which flash does not take here, through the
reference's fp32 path. An FP8 cache's keys and values are widened to the queries' dtype as they are gathered.

With KernelConfig.prefill_attention = "cudnn" ($MII_ASYNC_PREFILL=cudnn), the chunks go through cuDNN's fused
attention over the paged cache in place instead, where it takes them (kernels/cudnn_prefill.py).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import cudnn_prefill, kv_store, reference
from .metadata import AttentionMetadata, PrefillGroup


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor, window: int | None = None,
                      softcap: float | None = None, kernel: str = "flash") -> None:
    """As reference.prefill_attention: the prompt-chunk rows of q [T, Hq, D] written into `out`, each attending
    its last `window` positions where a window is given, with scores soft-capped where `softcap` is. `kernel`:
    "flash" or "cudnn" (KernelConfig.prefill_attention; cuDNN takes no window)."""
    if softcap is not None:
        reference.prefill_attention(q, k_cache, v_cache, meta, scale, out, window, softcap)
        return
    if kernel == "cudnn" and cudnn_prefill.supported(q, k_cache, window, softcap):
        cudnn_prefill.prefill(q, k_cache, v_cache, meta, scale, out)
        return
    if not _flash_varlen_ok(q) or (window is not None and not _flash_window_available()):
        _prefill_per_sequence(q, k_cache, v_cache, meta, scale, out, window)
        return
    groups = meta.prefill_groups
    if groups is None:                      # metadata not built by the runner (tests, tools): build it here
        groups = _groups_from(meta, k_cache.shape[1], q.device)
    # flash's window: a query at (aligned) position i sees keys i - left … i + right
    sliding = dict(window_size_left=window - 1, window_size_right=0) if window is not None else {}
    for g in groups:
        a, b = g.rows
        o = torch.ops.aten._flash_attention_forward(
            q[a:b], kv_store.gather(k_cache, g.kv_slots, q.dtype), kv_store.gather(v_cache, g.kv_slots, q.dtype),
            g.cu_q, g.cu_k,
            g.max_q, g.max_k, 0.0, True, False, scale=scale, **sliding)[0]
        out[a:b] = o


@functools.cache
def _flash_available() -> bool:
    check = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(check and check()) and hasattr(torch.ops.aten, "_flash_attention_forward") \
        and torch.cuda.get_device_capability() >= (8, 0)


@functools.cache
def _flash_window_available() -> bool:
    """Whether this torch's flash forward takes a window (its schema names window_size_left)."""
    return "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)


def _flash_varlen_ok(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256 and _flash_available()


def _groups_from(meta: AttentionMetadata, block_size: int, device: torch.device) -> tuple[PrefillGroup, ...]:
    from .metadata import device_groups, prefill_layout

    layout, groups = prefill_layout(meta.block_tables.cpu().numpy(), meta.query_lens, meta.context_lens_host,
                                    meta.num_decodes, block_size)
    return device_groups(torch.from_numpy(layout).to(device), groups)


def _prefill_per_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float, out: torch.Tensor, window: int | None = None) -> None:
    """One sequence at a time through SDPA's fused kernels: flash for a whole causal prompt, memory-efficient
    for a chunk over earlier chunks or a window (a boolean mask). Both keep the scores in fp32; the reference's
    GQA call takes torch's math path on CUDA, which rounds the scores to bf16 and, over 32 layers, drifts 4x
    further from fp32 than transformers does. K/V heads are expanded to the query heads so that the fused
    kernels take the call. Keys before the first query's window are left out of the gather."""
    bs = k_cache.shape[1]
    hq, hkv = q.shape[1], k_cache.shape[2]
    start = meta.num_decodes
    for s in range(meta.num_decodes, len(meta.query_lens)):
        qlen, clen = meta.query_lens[s], meta.context_lens_host[s]
        lo = max(0, clen - qlen - window + 1) if window is not None else 0
        blocks = meta.block_tables[s, lo // bs:-(-clen // bs)]
        first = lo // bs * bs                                              # the gather's first position
        keys = kv_store.select_blocks(k_cache, blocks).flatten(0, 1)[lo - first:clen - first].to(q.dtype)
        vals = kv_store.select_blocks(v_cache, blocks).flatten(0, 1)[lo - first:clen - first].to(q.dtype)
        if hq != hkv:
            keys = keys.repeat_interleave(hq // hkv, dim=1)
            vals = vals.repeat_interleave(hq // hkv, dim=1)
        qs = q[start:start + qlen].transpose(0, 1).unsqueeze(0)           # [1, Hq, L, D]
        ks, vs = keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)
        if qlen == clen and window is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            qpos = torch.arange(clen - qlen, clen, device=q.device)[:, None]
            kpos = torch.arange(lo, clen, device=q.device)[None, :]
            mask = kpos <= qpos                                            # [L, C']
            if window is not None:
                mask &= kpos > qpos - window
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[start:start + qlen] = o[0].transpose(0, 1)
        start += qlen
