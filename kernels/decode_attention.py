"""Decode attention on the GPU: one query token per sequence over its paged KV cache, in one of three CUDA
kernels with one contract (grid (KV heads, sequences, splits of the context); the last split of a (sequence,
KV head) combines the others in the same launch, csrc/decode_combine.cuh):
  - mma (csrc/paged_attention_mma.cu): tensor cores, head dim 128, up to 16 query heads per KV head;
  - stream (csrc/paged_attention_stream.cu): one scalar pass, head dim 128, up to 4;
  - split (csrc/paged_attention_decode.cu): two phases, every shape decode_supported() admits.
KernelConfig.decode_kernel (or `kernel=`) picks one; it takes the next where it does not apply.

An FP8 cache (kv_cache_dtype="fp8") takes the kernels compiled with MII_KV_FP8: mma and split read e4m3 K/V
(the queries and output stay in the model dtype); stream does not, and gives way to split.

A sliding window W moves each sequence's partitions to start at max(0, context - W): the grid covers
min(max_context_len, W) tokens, a per-layer constant under a CUDA graph's fixed context cap, and the blocks
before the window are never read. A soft-cap c turns each score s·scale into c·tanh(s·scale / c) before the
softmax (Gemma 2)."""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .config import DECODE_KERNELS, DEFAULT, GRID_ORDERS, KernelConfig
from .kv_store import FP8_KV
from .launch import launch as _launch, ptr as _ptr, resident_blocks, sm_count as _sm_count

DECODE_THREADS = 128            # NUM_THREADS in paged_attention_decode.cu
MAX_GQA = 16                    # MAX_G there: query heads per KV head
PARTITIONS = (512, 256, 128, 64, 32)   # decode split lengths, in tokens, longest first
EVEN_SPLIT_MIN = 32             # the shortest split of a span shared evenly (`split_lengths`)
# The one-pass kernels' shared-memory rings, per warp: STAGES (2 and 4 there) × rows a stage holds (16 and 4)
# × (K, V) × head dim 128 × 2 bytes.
RING_BYTES_PER_WARP = {"mma": 2 * 16 * 2 * 128 * 2, "stream": 4 * 4 * 2 * 128 * 2}
# Over an e4m3 cache (MII_KV_FP8) mma's ring holds 1-byte rows, and a warp's fp16 copy of a V tile follows it.
RING_BYTES_PER_WARP_FP8 = {"mma": 2 * 16 * 2 * 128 + 16 * 128 * 2}


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
                           partition: int | None = None, kernel: str | None = None,
                           warps: int | None = None, grid: str | None = None, window: int | None = None,
                           softcap: float | None = None, *, min_partition: int | None = None,
                           config: KernelConfig = DEFAULT) -> torch.Tensor:
    """Decode attention: q [S, Hq, D] (one token per sequence) over each sequence's cached keys →
    [S, Hq, D]. block_tables [S, max_blocks] and context_lens [S] int64 on the GPU. `kernel`, `warps` and
    `grid` override `config` for this call: `kernel` "mma", "stream" or "split" (config.decode_kernel), each
    taking the next where it does not apply; `warps` the mma kernel's block width, 2 or 4
    (config.mma_warps); `grid` the blocks' launch order, "kv_heads" (grid (Hkv, S, splits): a sequence's KV
    heads side by side; decode_combine.cuh) or "sequences" ((S, Hkv, splits), compiled apart, for probes)
    (config.decode_grid). `window`: each sequence attends to its last `window` tokens only; `softcap`: scores
    soft-capped (None: neither). `partition`: the most tokens a block reads (None: `split_lengths`'
    choice); `min_partition`: the fewest it reads of a sequence that reaches its split (None: `partition`) —
    in between, each sequence's span is shared evenly by the splits (csrc/decode_combine.cuh, split_length)."""
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap!r}")
    if kernel is None:
        kernel = config.decode_kernel
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(DECODE_KERNELS)}, got {kernel!r}")
    if warps not in (None, 2, 4):
        raise ValueError(f"warps must be 2 or 4, got {warps!r}")
    if grid is None:
        grid = config.decode_grid
    if grid not in GRID_ORDERS:
        raise ValueError(f"grid must be one of {', '.join(GRID_ORDERS)}, got {grid!r}")
    s, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    assert decode_supported(hq, hkv, d), f"no decode kernel for Hq={hq}, Hkv={hkv}, D={d}"
    assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty_like(q) if out is None else out
    if s == 0:
        return out
    span = min(max_context_len, window) if window is not None else max_context_len   # tokens a sequence reads
    if s > 65535:
        grid = "sequences"             # a grid's y dimension holds 65,535 blocks: the sequences go on x then
    fp8 = k_cache.dtype == FP8_KV
    defines = (() if grid == "kv_heads" else ("MII_SEQ_MAJOR_GRID",)) + (("MII_KV_FP8",) if fp8 else ())
    one_pass = ("mma" if kernel == "mma" and _mma_ok(q, hkv) else
                "stream" if kernel in ("mma", "stream") and _stream_ok(q, hkv) and not fp8 else None)
    if one_pass is not None:
        nwarps = DECODE_THREADS // 32
        if one_pass == "mma":
            nwarps = warps if warps is not None else config.mma_warps(s * hkv)
        name = f"paged_attention_{one_pass}" + ("_w2" if one_pass == "mma" and nwarps == 2 else "")
        ring = nwarps * (RING_BYTES_PER_WARP_FP8 if fp8 else RING_BYTES_PER_WARP)[one_pass]
    if partition is None:
        slots = 0                      # the split kernel's shared memory grows with its partition: not known
        if one_pass is not None:
            # asked of the default grid order's build, so that both orders take the same lengths (the same bits)
            slots = _sm_count() * resident_blocks(f"paged_attention_{one_pass}", name, q.dtype, 32 * nwarps,
                                                  ring + 8 * (PARTITIONS[0] // bs + 2),
                                                  tuple(x for x in defines if x != "MII_SEQ_MAJOR_GRID"))
        partition, even_from = split_lengths(s * hkv, span, _sm_count(), slots, bs)
        min_partition = even_from if min_partition is None else min_partition
    min_partition = partition if min_partition is None else min(min_partition, partition)
    if min_partition < 1:
        raise ValueError(f"min_partition must be at least 1, got {min_partition!r}")
    splits = max(1, -(-span // partition))
    smem = 4 * (g * d + g * partition + 32) + 8 * partition + 4 * (DECODE_THREADS // 32) * g * d
    if splits > 1:
        part_out = torch.empty((s, hq, splits, d), dtype=torch.float32, device=q.device)
        part_max = torch.empty((s, hq, splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty((s, hq, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_max = part_sum = out                   # unused with one split
    bt = block_tables.contiguous()
    cl = context_lens.contiguous()
    extra = (np.int32(window or 0), np.float32(softcap or 0.0))   # the kernels' window and softcap: 0 for none
    dims = (hkv, s, splits) if grid == "kv_heads" else (s, hkv, splits)
    if one_pass is not None:
        _launch(f"paged_attention_{one_pass}", name, q.dtype, dims, (32 * nwarps,),
                (_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(bt), _ptr(cl), _ptr(out),
                 _ptr(part_out), _ptr(part_max), _ptr(part_sum),
                 _ptr(_split_counters(s * hkv, q.device)), np.int32(hq), np.int32(hkv),
                 np.int32(bs), np.int32(bt.shape[1]), np.int32(partition), np.int32(min_partition),
                 np.float32(scale), *extra),
                shared_mem=ring + 8 * (partition // bs + 2),  # rings, block ids
                defines=defines, pdl=config.pdl)
        return out
    gbound = next(b for b in (4, 8, MAX_GQA) if g <= b)       # the kernel sized for this GQA ratio
    _launch("paged_attention_decode", f"paged_attention_decode_g{gbound}", q.dtype, dims, (DECODE_THREADS,),
            (_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(bt), _ptr(cl), _ptr(out), _ptr(part_out), _ptr(part_max),
             _ptr(part_sum), _ptr(_split_counters(s * hkv, q.device)), np.int32(hq), np.int32(hkv), np.int32(d),
             np.int32(bs), np.int32(bt.shape[1]), np.int32(partition), np.int32(min_partition), np.float32(scale),
             *extra), shared_mem=smem,
            defines=defines, pdl=config.pdl)
    return out


def split_lengths(pairs: int, span: int, sms: int, slots: int, block_size: int) -> tuple[int, int]:
    """(partition, min_partition) of a decode launch for `pairs` (sequence, KV head) pairs over `span` tokens
    each, on `sms` SMs that hold `slots` blocks of the kernel at once (0: not known): the most tokens of context
    a block reads, and the fewest (of a sequence shorter than the span, whose span the splits share evenly).

    Many pairs: the longest of PARTITIONS that still gives two blocks an SM, in fixed splits (min_partition =
    partition: more splits would add partial outputs to a launch that fills the card anyway). Small batches
    take short ones (down to 32 tokens), since a block's PV loop walks its partition serially. Where those
    blocks make fewer than two waves of the resident slots, a last wave partly full leaves most of the card idle
    for a block's time (one sequence over 32k tokens in 512-token partitions: 512 blocks against 396 slots on an
    H100). The partition is then the one whose waves, times its length, are fewest — a whole number of waves,
    each block's walk no longer than needed — the longest among equals (fewer splits to combine); a multiple of
    the cache block. Those splits are shared evenly, down to 32 tokens: a CUDA graph launches them for its
    context cap, and a context of a quarter of the cap then takes all of them, not a quarter."""
    p = next((p for p in PARTITIONS if pairs * -(-span // p) >= 2 * sms), PARTITIONS[-1])
    blocks = pairs * -(-span // p)
    if slots <= 0 or blocks >= 2 * slots:
        return p, p
    unit = math.lcm(block_size, 16)                           # whole cache blocks and whole 16-token tiles
    best, best_cost = p, _ceil(blocks, slots) * p
    for waves in (1, 2, 3):
        splits = waves * slots // pairs                       # the most splits that fit these waves
        if splits < 1:
            continue
        part = max(_ceil(32, unit), _ceil(_ceil(span, splits), unit)) * unit
        cost = _ceil(pairs * _ceil(span, part), slots) * part
        if cost < best_cost or (cost == best_cost and part > best):
            best, best_cost = part, cost
    return best, min(best, EVEN_SPLIT_MIN)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _mma_ok(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Shapes paged_attention_mma.cu takes: head dim 128, at most 16 query heads per KV head (an mma tile's
    rows), bf16 / fp16, 16-byte aligned queries, and mma.sync / cp.async (sm_80 on)."""
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[2] == 128 and q.shape[1] // num_kv_heads <= 16
            and q.data_ptr() % 16 == 0 and _cp_async_capable(q.device.index))


def _stream_ok(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Shapes paged_attention_stream.cu takes: head dim 128, at most 4 query heads per KV head, bf16 / fp16,
    16-byte aligned rows, and cp.async (sm_80 on)."""
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[2] == 128 and q.shape[1] // num_kv_heads <= 4
            and q.data_ptr() % 16 == 0 and _cp_async_capable(q.device.index))


@functools.cache
def _cp_async_capable(device: int | None) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)
