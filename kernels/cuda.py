"""CuPy/CUDA backend of the op set: the same signatures as reference.py, on torch CUDA tensors.

Kernels are compiled from csrc/*.cu by CuPy (NVRTC, `-arch=sm_90` on Hopper, the device's own arch
elsewhere) once per process, and CuPy keeps the binaries in its on-disk cache (~/.cupy/kernel_cache), so
later processes load them without compiling. Every launch goes on torch's current stream (an ExternalStream
over its handle), so that kernels order with torch's own work and are captured by torch.cuda.CUDAGraph.
Prompt chunks go through torch's variable-length flash attention, all chunks of a step in one call per layer
(`prefill_attention`); the standalone rotary and KV write, and decode shapes the kernel does not handle
(`decode_supported`), run the torch reference on the GPU.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from . import reference
from .metadata import AttentionMetadata

CSRC = Path(__file__).parent / "csrc"
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
DECODE_THREADS = 128            # NUM_THREADS in paged_attention_decode.cu
MAX_GQA = 16                    # MAX_G there: query heads per KV head
PARTITIONS = (512, 256, 128, 64, 32)   # decode split lengths, in tokens, longest first
RAGGED_PREFILL = True           # takes AttentionMetadata.prefill_groups (the runner builds them)

rotary_embedding = reference.rotary_embedding
write_kv = reference.write_kv


@functools.cache
def _module(name: str):
    import cupy as cp

    major, minor = torch.cuda.get_device_capability()
    arch = f"-arch=sm_{major}{minor}"
    return cp.RawModule(code=(CSRC / f"{name}.cu").read_text(), options=("--std=c++17", f"-I{CSRC}", arch))


@functools.cache
def _kernel(module: str, name: str, dtype: torch.dtype):
    return _module(module).get_function(f"{name}_{SUFFIX[dtype]}")


@functools.cache
def _stream(handle: int, device: int):
    import cupy as cp

    return cp.cuda.ExternalStream(handle, device)


@functools.cache
def _sm_count() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _launch(module: str, name: str, dtype: torch.dtype, grid: tuple, block: tuple, args: tuple,
            shared_mem: int = 0) -> None:
    k = _kernel(module, name, dtype)
    if shared_mem > 48 * 1024:
        k.max_dynamic_shared_size_bytes = shared_mem
    stream = torch.cuda.current_stream()
    with _stream(stream.cuda_stream, stream.device_index):
        k(grid, block, args, shared_mem=shared_mem)


def _rows(x: torch.Tensor) -> tuple[int, int]:
    """Row count and row stride of a [T, H] tensor whose rows are contiguous."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"rows must be contiguous, got strides {x.stride()}"
    return x.shape[0], x.stride(0)


def _threads(n: int) -> int:
    return min(1024, max(32, (n + 31) // 32 * 32))


def _vec(n: int, strides: tuple[int, ...], *tensors: torch.Tensor) -> bool:
    """Whether rows of `n` elements at these strides, in these tensors (one dtype), move in 16-byte vectors:
    every row start 16-byte aligned and n a whole number of vectors."""
    v = 16 // tensors[0].element_size()
    return n % v == 0 and all(st % v == 0 for st in strides) and all(t.data_ptr() % 16 == 0 for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    t, stride = _rows(x)
    h = x.shape[1]
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    weight = weight.contiguous()
    vec = _vec(h, (stride,), x, weight)
    if t:
        _launch("norms", "rms_norm", x.dtype, (t,), (_threads(h // (16 // x.element_size() if vec else 4)),),
                (_ptr(x), _ptr(weight), _ptr(out), np.int32(h), np.int64(stride), np.float32(eps), np.int32(vec)),
                shared_mem=h * 4)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    t, xs = _rows(x)
    _, rs = _rows(residual)
    h = x.shape[1]
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    res = torch.empty((t, h), dtype=x.dtype, device=x.device)
    weight = weight.contiguous()
    vec = _vec(h, (xs, rs), x, residual, weight)
    if t:
        _launch("norms", "fused_add_rms_norm", x.dtype, (t,), (_threads(h // (16 // x.element_size() if vec else 4)),),
                (_ptr(x), _ptr(residual), _ptr(weight), _ptr(out), _ptr(res), np.int32(h),
                 np.int64(xs), np.int64(rs), np.float32(eps), np.int32(vec)), shared_mem=h * 4)
    return out, res


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    t, stride = _rows(x)
    f = x.shape[1] // 2
    out = torch.empty((t, f), dtype=x.dtype, device=x.device)
    vec = _vec(f, (stride,), x)
    if t:
        threads = 256
        per_thread = 16 // x.element_size() if vec else 1
        _launch("activation", "silu_and_mul", x.dtype, (min(-(-f // (threads * per_thread)), 64), t), (threads,),
                (_ptr(x), _ptr(out), np.int32(f), np.int64(stride), np.int32(vec)))
    return out


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    t, hq, d = q.shape
    hkv = k.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert x.stride(2) == 1 and x.stride(1) == d, f"{name}: heads must be contiguous, got strides {x.stride()}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == q.dtype
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t:
        _launch("rotary_kv", "rotary_write_kv", q.dtype, (t,), (_threads(max(hq, hkv) * d // 2),),
                (_ptr(positions.contiguous()), _ptr(q), _ptr(k), _ptr(v), _ptr(cos_sin), _ptr(q_out), _ptr(k_cache),
                 _ptr(v_cache), _ptr(slot_mapping.contiguous()), np.int32(hq), np.int32(hkv), np.int32(d),
                 np.int64(q.stride(0)), np.int64(k.stride(0)), np.int64(v.stride(0))))
    return q_out


_counters: dict[int, torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def _split_counters(n: int, device: torch.device) -> torch.Tensor:
    """The decode kernel's per-(sequence, KV head) split counters: zeroed once, and left at zero by every
    launch (the last split resets its own), so no memset per call. A larger need gets a new buffer; the old one
    is kept, since captured graphs hold its address."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    c = _counters.get(idx)
    if c is None or c.numel() < n:
        if c is not None:
            _retired.append(c)
        c = _counters[idx] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return c


def decode_supported(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Shapes the decode kernel handles: head dims 32 … 256 in steps of 32, up to MAX_GQA query heads per KV
    head. (Others — the tests' tiny models have head dim 8 — take the reference.)"""
    return (num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads <= MAX_GQA and head_dim % 32 == 0
            and 32 <= head_dim <= 256)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int,
                           scale: float, out: torch.Tensor | None = None,
                           partition: int | None = None) -> torch.Tensor:
    """Decode attention: q [S, Hq, D] (one token per sequence) over each sequence's cached keys →
    [S, Hq, D]. block_tables [S, max_blocks] and context_lens [S] int64 on the GPU."""
    s, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    assert decode_supported(hq, hkv, d), f"no decode kernel for Hq={hq}, Hkv={hkv}, D={d}"
    assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty_like(q) if out is None else out
    if s == 0:
        return out
    if partition is None:
        # Fill the GPU: the longest partition that still gives 2 blocks per SM. Small batches take short ones
        # (down to 32 tokens): a block's PV loop walks its partition serially, so that is its latency.
        partition = next((p for p in PARTITIONS if s * hkv * -(-max_context_len // p) >= 2 * _sm_count()),
                         PARTITIONS[-1])
    splits = max(1, -(-max_context_len // partition))
    smem = 4 * (g * d + g * partition + 32) + 8 * partition + 4 * (DECODE_THREADS // 32) * g * d
    if splits > 1:
        part_out = torch.empty((s, hq, splits, d), dtype=torch.float32, device=q.device)
        part_max = torch.empty((s, hq, splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty((s, hq, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_max = part_sum = out                   # unused with one split
    bt = block_tables.contiguous()
    cl = context_lens.contiguous()
    gbound = next(b for b in (4, 8, MAX_GQA) if g <= b)       # the kernel sized for this GQA ratio
    _launch("paged_attention_decode", f"paged_attention_decode_g{gbound}", q.dtype, (s, hkv, splits), (DECODE_THREADS,),
            (_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(bt), _ptr(cl), _ptr(out), _ptr(part_out), _ptr(part_max),
             _ptr(part_sum), _ptr(_split_counters(s * hkv, q.device)), np.int32(hq), np.int32(hkv), np.int32(d),
             np.int32(bs), np.int32(bt.shape[1]), np.int32(partition), np.float32(scale)), shared_mem=smem)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """As reference.paged_attention: decodes through the split kernel, prompt chunks through the reference."""
    nd = meta.num_decodes
    q = q.contiguous()
    out = torch.empty_like(q)
    if nd and not decode_supported(q.shape[1], k_cache.shape[2], q.shape[2]):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale)
    if nd:
        paged_attention_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd],
                               max(meta.context_lens_host[:nd]), scale, out=out[:nd])
    if nd < len(meta.query_lens):
        prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor) -> None:
    """The prompt-chunk rows of a step (from num_decodes on), written into `out`. In bf16 / fp16, every chunk
    of a group in one call of torch's variable-length flash attention: its keys and values are gathered from
    the blocked cache with one index each (`meta.prefill_groups`), GQA is native, and a chunk's causal mask is
    aligned to the end of its context (a chunk over earlier chunks sees all of them). Scores stay in fp32.
    Other dtypes, or a torch without flash attention, take `_prefill_per_sequence`."""
    if not _flash_varlen_ok(q):
        _prefill_per_sequence(q, k_cache, v_cache, meta, scale, out)
        return
    groups = meta.prefill_groups
    if groups is None:                      # metadata not built by the runner (tests, tools): build it here
        groups = _groups_from(meta, k_cache.shape[1], q.device)
    n, bs, hkv, d = k_cache.shape
    keys, vals = k_cache.view(n * bs, hkv, d), v_cache.view(n * bs, hkv, d)
    for g in groups:
        a, b = g.rows
        o = torch.ops.aten._flash_attention_forward(
            q[a:b], keys.index_select(0, g.kv_slots), vals.index_select(0, g.kv_slots), g.cu_q, g.cu_k,
            g.max_q, g.max_k, 0.0, True, False, scale=scale)[0]
        out[a:b] = o


@functools.cache
def _flash_available() -> bool:
    check = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(check and check()) and hasattr(torch.ops.aten, "_flash_attention_forward") \
        and torch.cuda.get_device_capability() >= (8, 0)


def _flash_varlen_ok(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256 and _flash_available()


def _groups_from(meta: AttentionMetadata, block_size: int, device: torch.device):
    from .metadata import device_groups, prefill_layout

    layout, groups = prefill_layout(meta.block_tables.cpu().numpy(), meta.query_lens, meta.context_lens_host,
                                    meta.num_decodes, block_size)
    return device_groups(torch.from_numpy(layout).to(device), groups)


def _prefill_per_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float, out: torch.Tensor) -> None:
    """One sequence at a time through SDPA's fused kernels: flash for a whole causal prompt, memory-efficient
    for a chunk over earlier chunks (its mask is bottom-right causal). Both keep the scores in fp32; the
    reference's GQA call takes torch's math path on CUDA, which rounds the scores to bf16 and, over 32 layers,
    drifts 4x further from fp32 than transformers does. K/V heads are expanded to the query heads so that the
    fused kernels take the call."""
    import torch.nn.functional as F

    bs = k_cache.shape[1]
    hq, hkv = q.shape[1], k_cache.shape[2]
    start = meta.num_decodes
    for s in range(meta.num_decodes, len(meta.query_lens)):
        qlen, clen = meta.query_lens[s], meta.context_lens_host[s]
        nb = -(-clen // bs)
        blocks = meta.block_tables[s, :nb]
        keys = k_cache[blocks].flatten(0, 1)[:clen]                        # [C, Hkv, D]
        vals = v_cache[blocks].flatten(0, 1)[:clen]
        if hq != hkv:
            keys = keys.repeat_interleave(hq // hkv, dim=1)
            vals = vals.repeat_interleave(hq // hkv, dim=1)
        qs = q[start:start + qlen].transpose(0, 1).unsqueeze(0)           # [1, Hq, L, D]
        ks, vs = keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)
        if qlen == clen:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            qpos = torch.arange(clen - qlen, clen, device=q.device)
            mask = torch.arange(clen, device=q.device)[None, :] <= qpos[:, None]   # [L, C]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[start:start + qlen] = o[0].transpose(0, 1)
        start += qlen
