"""Prompt-chunk attention through cuDNN's fused attention (the `nvidia-cudnn-frontend` package), over the paged
KV cache in place: KernelConfig.prefill_attention = "cudnn" ($MII_ASYNC_PREFILL=cudnn).

One cuDNN graph serves every step of a shape bucket: the step's chunks are packed query rows (ragged offsets
on Q and O), each sequence's keys are read through its block table (cuDNN's paged attention, the cache's
[block, token, KV head, dim] layout declared with strides, never gathered), GQA is native, and the causal
mask is aligned bottom-right per sequence from its real lengths (padding mask): query j of a chunk of L over
a context of C sees keys ≤ C − L + j. Lengths, offsets and tables are device tensors filled once a step and
shared by every layer (`meta.memo`); a graph is built (some 0.1–0.5 s, logged) the first time its bucket is
met: sequences a step, the longest chunk, the longest context, each rounded up to a power of four (from 1, 128
and 1024 cache blocks).

What it does not take goes to the flash path (kernels/prefill_attention.py): an FP8 cache, a sliding window,
soft-capped scores, a head dim cuDNN does not take, a block size that is not a power of two.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import NamedTuple

import torch

from .metadata import AttentionMetadata

log = logging.getLogger("mii_async.kernels.cudnn_prefill")
MIN_BACKEND = 90700             # paged K/V with ragged queries (cuDNN 9.7)
MIN_BUCKET_Q = 128              # the query bucket's floor: cuDNN's prefill tiles
MIN_BUCKET_PAGES = 1024         # the context bucket's floor, in cache blocks (16k tokens in blocks of 16)
BUCKET_STEP = 4                 # each bucket this many times the one below: few graphs to build, and a launch
                                # sized at most 4x the step (tiles past a chunk's end do nothing)


@functools.cache
def _cudnn():
    """The frontend module, or None where it is not installed or its cuDNN is too old. Imported after torch
    has loaded its own libcudnn, which the frontend then finds."""
    try:
        torch.backends.cudnn.version()
        import cudnn
    except (ImportError, OSError) as e:
        log.warning("prefill_attention='cudnn': nvidia-cudnn-frontend does not load (%s); prompt attention "
                    "stays on torch's flash attention", e)
        return None
    if cudnn.backend_version() < MIN_BACKEND:
        log.warning("prefill_attention='cudnn': cuDNN %s is older than 9.7 (paged attention with packed "
                    "queries); prompt attention stays on torch's flash attention", cudnn.backend_version_string())
        return None
    return cudnn


def supported(q: torch.Tensor, k_cache: torch.Tensor, window: int | None, softcap: float | None) -> bool:
    """Whether this call can go through cuDNN: 16-bit queries over a cache of the same type, no window, no
    soft-cap, head dim a multiple of 8 up to 128 (256 on Hopper), a power-of-two block size, a GPU of sm_80
    on, and the frontend installed."""
    d, bs = q.shape[-1], k_cache.shape[1]
    cap = _capability(q.device.index)
    return (q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype and window is None
            and softcap is None and d % 8 == 0 and d <= (256 if cap[0] == 9 else 128) and bs & (bs - 1) == 0
            and cap >= (8, 0) and q.is_contiguous() and _cudnn() is not None)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


class _Key(NamedTuple):
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    blocks: int                 # the cache's blocks
    block_size: int
    scale: float
    batch: int                  # bucket: sequences with a chunk
    max_q: int                  # bucket: the longest chunk
    pages: int                  # bucket: the longest context, in cache blocks


class _Graph(NamedTuple):
    graph: object
    q: object
    k: object
    v: object
    o: object
    q_offsets: object
    o_offsets: object
    seq_q: object
    seq_kv: object
    table: object
    workspace: torch.Tensor


class _StepInputs(NamedTuple):
    key_bucket: tuple[int, int, int]    # (batch, max_q, pages)
    offsets: torch.Tensor       # [batch + 1, 1, 1, 1] int32: element offset of each chunk's first row, Q and O
    seq_q: torch.Tensor         # [batch, 1, 1, 1] int32: chunk lengths (0 past the step's chunks)
    seq_kv: torch.Tensor        # [batch, 1, 1, 1] int32: context lengths
    table: torch.Tensor         # [batch, 1, pages, 1] int32: block tables


_handles: dict[int, object] = {}
_graphs: dict[_Key, _Graph] = {}


def bucket(n: int, floor: int) -> int:
    """The smallest floor · BUCKET_STEP^k that holds n."""
    b = floor
    while b < n:
        b *= BUCKET_STEP
    return b


def step_inputs(meta: AttentionMetadata, heads: int, head_dim: int, block_size: int,
                device: torch.device) -> _StepInputs:
    """The chunks' lengths, packed offsets and block tables, padded to the step's bucket. Sequences from
    meta.num_decodes on; a padded sequence has no queries and no keys. Built on the host from its copies of
    the lengths; the tables are cut from the step's on the device."""
    nd = meta.num_decodes
    qlens, clens = meta.query_lens[nd:], meta.context_lens_host[nd:]
    n = len(qlens)
    batch = bucket(n, 1)
    pages = bucket(-(-max(clens) // block_size), MIN_BUCKET_PAGES)
    host = torch.zeros(3 * batch + 1, dtype=torch.int32)
    host[1:n + 1] = torch.tensor(qlens, dtype=torch.int32).cumsum(0) * (heads * head_dim)
    host[n + 1:batch + 1] = host[n]
    host[batch + 1:batch + 1 + n] = torch.tensor(qlens, dtype=torch.int32)
    host[2 * batch + 1:2 * batch + 1 + n] = torch.tensor(clens, dtype=torch.int32)
    dev = host.to(device, non_blocking=True)
    table = torch.zeros((batch, pages), dtype=torch.int32, device=device)
    width = min(pages, meta.block_tables.shape[1])
    table[:n, :width] = meta.block_tables[nd:, :width]
    return _StepInputs((batch, bucket(max(qlens), MIN_BUCKET_Q), pages), dev[:batch + 1].view(-1, 1, 1, 1),
                       dev[batch + 1:2 * batch + 1].view(-1, 1, 1, 1),
                       dev[2 * batch + 1:].view(-1, 1, 1, 1), table.view(batch, 1, pages, 1))


def _handle(cudnn, device: torch.device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _handles:
        with torch.cuda.device(idx):
            _handles[idx] = cudnn.create_handle()
    return _handles[idx]


def _build(cudnn, key: _Key, device: torch.device) -> _Graph:
    """The graph of one bucket: Q [batch, H, max_q, D] packed by ragged offsets (row stride H·D), K/V as the
    cache's blocks [blocks, Hkv, block_size, D] through [batch, 1, pages, 1] tables, O as Q."""
    t0 = time.perf_counter()
    io = cudnn.data_type.BFLOAT16 if key.dtype == torch.bfloat16 else cudnn.data_type.HALF
    i32, f32 = cudnn.data_type.INT32, cudnn.data_type.FLOAT
    b, h, hkv, d, bs, sq = key.batch, key.heads, key.kv_heads, key.head_dim, key.block_size, key.max_q
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32,
                      handle=_handle(cudnn, device))
    rows = [sq * h * d, d, h * d, 1]                        # packed [T, H, D] rows seen as [b, H, max_q, D]
    q = g.tensor(name="q", dim=[b, h, sq, d], stride=rows, data_type=io)
    q_off = g.tensor(name="q_offsets", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    q.set_ragged_offset(q_off)
    cache = [bs * hkv * d, d, hkv * d, 1]                    # [block, token, KV head, D] seen as [block, Hkv, token, D]
    k = g.tensor(name="k", dim=[key.blocks, hkv, bs, d], stride=cache, data_type=io)
    v = g.tensor(name="v", dim=[key.blocks, hkv, bs, d], stride=cache, data_type=io)
    table = g.tensor(name="table", dim=[b, 1, key.pages, 1], stride=[key.pages, key.pages, 1, 1], data_type=i32)
    seq_q = g.tensor(name="seq_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    seq_kv = g.tensor(name="seq_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    o, _ = g.sdpa(name="prefill", q=q, k=k, v=v, is_inference=True, attn_scale=key.scale,
                  use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv,
                  diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0,
                  paged_attention_k_table=table, paged_attention_v_table=table,
                  paged_attention_max_seq_len_kv=key.pages * bs)
    o_off = g.tensor(name="o_offsets", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    o.set_output(True).set_dim([b, h, sq, d]).set_stride(rows).set_ragged_offset(o_off)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=device)
    log.info("cuDNN prompt attention: built the graph of %d sequences × %d queries over %d blocks of %d in "
             "%.2f s", b, sq, key.pages, bs, time.perf_counter() - t0)
    return _Graph(g, q, k, v, o, q_off, o_off, seq_q, seq_kv, table, workspace)


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            out: torch.Tensor) -> None:
    """The prompt-chunk rows of q [T, Hq, D] (from meta.num_decodes on) attending causally over their sequences'
    cached keys, written into the same rows of `out` [T, Hq, D]. `supported` must hold."""
    cudnn = _cudnn()
    nd = meta.num_decodes
    hq, d = q.shape[1], q.shape[2]
    blocks, bs, hkv, _ = k_cache.shape
    memo = meta.memo
    inputs = memo.get(("cudnn_prefill", hq, d, bs))
    if inputs is None:
        inputs = memo[("cudnn_prefill", hq, d, bs)] = step_inputs(meta, hq, d, bs, q.device)
    key = _Key(q.dtype, hq, hkv, d, blocks, bs, float(scale), *inputs.key_bucket)
    g = _graphs.get(key)
    if g is None:
        g = _graphs[key] = _build(cudnn, key, q.device)
    rows = out if out.is_contiguous() else torch.empty_like(q)     # cuDNN writes packed [T, Hq, D] rows
    handle = _handle(cudnn, q.device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    g.graph.execute({g.q: q[nd:], g.k: k_cache, g.v: v_cache, g.o: rows[nd:], g.q_offsets: inputs.offsets,
                     g.o_offsets: inputs.offsets, g.seq_q: inputs.seq_q, g.seq_kv: inputs.seq_kv,
                     g.table: inputs.table}, g.workspace, handle=handle)
    if rows is not out:
        out[nd:] = rows[nd:]
