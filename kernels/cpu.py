"""The CPU op set: native kernels (csrc/cpu/cpu_ops.c, built for this CPU by cpu_build.py) for the small ops of
a decode step, torch for the GEMMs, the torch reference (reference.py) for the rest, with the reference's
signatures.

Why native code: a CPU decode step of a small model is a few thousand tiny torch ops, each a dispatch, an
allocation and, with several threads, an OpenMP fork and join; for the default model (SmolLM2-135M, int4, batch
1) they took about half of the step beside its GEMMs. Here each fused op of the model's forward between two GEMMs
(the norm with the residual add, rotary with the KV write, decode attention over the paged cache in place, the
gated activation) is one call of C code (decode attention's rows split over the step's threads), and the GEMMs
stay torch's (MKL/oneDNN, and its int4 / int8 weight-only kernels), which take the activations unquantized: the
default chat's first token is decided by 0.4% of its logit, which int8 activations (llama.cpp's Q8_1 dot) were
measured to move by 4-14%.

What runs natively: fp32 or bf16 activations, contiguous rows, a cache in the activations' dtype. Anything else
(an FP8 KV cache, fp16, a mixture of experts' routing, prompt chunks' attention) runs the reference, so every
model that runs on the reference runs here. The numbers: each op computes in fp32 and rounds where the reference
rounds (tests/kernels/test_cpu_ops.py holds each against it); the default model's prefill logits come within
2.5e-7 of the reference's in fp32, and within bf16's own noise in bf16 (1.6% over 30 layers, the same argmax), the
float sums' order being the difference.
"""
from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from . import reference
from .cpu_build import load
from .cpu_decode import decode_layers  # noqa: F401 (the op set: a decode step's layers in one call)
from .cpu_int4 import NativeInt4Weight, from_int4, packable
from .int_weight import Int4Weight, Int8Weight
from .metadata import AttentionMetadata
from .reference import moe_experts, moe_route, prefill_attention  # noqa: F401 (the op set)

RAGGED_PREFILL = False
CONFIGURED = ()
INT8_ROWS = 256             # rows of the int8 head a thread takes at a time

_DT = {torch.float32: 0, torch.bfloat16: 1}

_loaded: list = []
_head_threads = [1]
_pool: list[ThreadPoolExecutor] = []
_pool_lock = threading.Lock()
_CPUS = os.cpu_count() or 1


def _lib():
    if not _loaded:
        lib = load()
        if lib is None:
            raise RuntimeError("the CPU kernels are not built; the engine picks this op set only where they are")
        _loaded.append(lib)
    return _loaded[0]


def _native(first: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """All of them on the CPU, contiguous, in one dtype the kernels take (None: absent)."""
    dtype = first.dtype
    if dtype not in _DT or not first.is_cpu or not first.is_contiguous():
        return False
    return all(t is None or (t.dtype is dtype and t.is_cpu and t.is_contiguous()) for t in others)


def set_head_threads(n: int) -> None:
    """The threads the output head's GEMM takes even in a step the engine runs on fewer (its CPU threads)."""
    _head_threads[0] = max(1, n)


def _status(code: int, what: str = "") -> None:
    if code == -1:
        raise MemoryError("the CPU ops could not allocate their scratch memory")
    if code == -3:
        raise RuntimeError("the CPU library was built without this op's instructions")
    if code:
        raise IndexError(f"{what} out of range")


def _executor() -> ThreadPoolExecutor:
    """The helper threads, one fewer than the CPUs: made once and shared by every engine of the process (an
    executor is safe to submit to from several threads)."""
    with _pool_lock:
        if not _pool:
            _pool.append(ThreadPoolExecutor(max(1, _CPUS - 1), thread_name_prefix="mii-cpu-ops"))
        return _pool[0]


def _parallel(n: int, op, threads: int | None = None, chunk: int = 1) -> int:
    """op(a, b, team, owner) over the units [0, n) on `threads` threads (by default torch's intra-op count of the
    moment: the engine sets one for a batch-1 step, workers/cpu_plan.py). With several, this thread and its
    helpers share one team (csrc/cpu/team.h) and take `chunk` units at a time from it, so a helper that wakes late
    (its core busy with the router or the gateway) leaves the work to this thread instead of holding it up; this
    thread returns once every unit is done, with the first error status of any. ctypes lets go of the GIL during
    each call, so the threads run at once."""
    threads = min(threads or torch.get_num_threads(), -(-n // chunk), _CPUS)
    if threads <= 1:
        return op(0, n, None, 1)
    team = (ctypes.c_int64 * 6)(0, n, chunk, 0, 0, 0)   # next, total, chunk, active, closed, status
    ex = _executor()
    for _ in range(threads - 1):
        ex.submit(_help, op, n, team)
    return op(0, n, ctypes.addressof(team), 1)


def _help(op, n: int, team) -> None:
    """A helper's share: whatever is left when it starts (`team` is held here until it returns)."""
    op(0, n, ctypes.addressof(team), 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _native(x, weight) or x.dim() != 2:
        return reference.rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    _status(_lib().add_rms_norm(x.data_ptr(), None, None, weight.data_ptr(), eps, x.shape[0], x.shape[1],
                                _DT[x.dtype], out.data_ptr()))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not _native(x, residual, weight) or x.dim() != 2:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out, res = torch.empty_like(x), torch.empty_like(x)
    _status(_lib().add_rms_norm(x.data_ptr(), residual.data_ptr(), res.data_ptr(), weight.data_ptr(), eps,
                                x.shape[0], x.shape[1], _DT[x.dtype], out.data_ptr()))
    return out, res


def _gated(x: torch.Tensor, gelu: int) -> torch.Tensor:
    t, f2 = x.shape
    out = torch.empty(t, f2 // 2, dtype=x.dtype)
    _lib().gated_act(x.data_ptr(), t, f2 // 2, _DT[x.dtype], gelu, out.data_ptr())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated(x, 0) if _native(x) and x.dim() == 2 else reference.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated(x, 1) if _native(x) and x.dim() == 2 else reference.gelu_tanh_and_mul(x)


def adopt_weight(weight):
    """A projection as it loads (workers/model/weights.py): an int4 one in the native GEMM's layout where this
    CPU runs it (cpu_int4.py), anything else as it is."""
    if isinstance(weight, Int4Weight) and packable(weight) and _lib().int4_gemm_native():
        return from_int4(weight)
    return weight


def _int4_linear(x: torch.Tensor, weight: NativeInt4Weight) -> torch.Tensor:
    """x [T, K] · weightᵀ in bf16 (as torch's int4 kernel, x is cast to bf16 and the result back), the 64-row
    blocks split over the step's threads."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"an int4 projection of {k} columns takes x [T, {k}], got {list(x.shape)}")
    xb = x.to(torch.bfloat16).contiguous()
    y = torch.empty(xb.shape[0], n, dtype=torch.bfloat16)
    if not xb.shape[0]:                 # no rows (a step that samples none): nothing for the C code to read
        return y.to(x.dtype)
    lib, args = _lib(), (weight.codes.data_ptr(), weight.scale_zeros.data_ptr(), n, k, xb.data_ptr(), xb.shape[0],
                         y.data_ptr())
    _status(_parallel(weight.codes.shape[0], lambda a, b, team, owner: lib.int4_gemm(*args, a, b, team, owner)))
    return y.to(x.dtype)


def _int8_native(x: torch.Tensor, weight: Int8Weight) -> bool:
    return (x.dtype in _DT and x.dim() == 2 and x.is_contiguous() and weight.scale.dtype == x.dtype
            and weight.weight.is_contiguous() and weight.shape[1] % 16 == 0 and x.shape[1] == weight.shape[1]
            and _lib().int8_gemm_native() == 1)


def _int8_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x [T, K] · (int8 rows · scale)ᵀ natively, the rows split over the head's threads (set_head_threads)."""
    n, k = weight.shape
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    if not x.shape[0]:
        return y
    lib, args = _lib(), (weight.weight.data_ptr(), weight.scale.data_ptr(), n, k, x.data_ptr(), x.shape[0],
                         _DT[x.dtype], y.data_ptr())
    _status(_parallel(n, lambda a, b, team, owner: lib.int8_gemm(*args, a, b, team, owner), _head_threads[0],
                      INT8_ROWS))
    return y


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The native GEMMs for an adopted int4 weight and for the int8 head; torch's otherwise (reference.linear:
    MKL/oneDNN for dense weights, its int8 kernel where the native one does not apply). The output head (the int8
    weight of int4's scheme) runs on the engine's threads even in a batch-1 step, which the engine otherwise runs
    on one: it is a fifth of the step's bytes in one GEMM, worth a second thread."""
    if type(weight) is NativeInt4Weight:
        y = _int4_linear(x, weight)
        return y + bias if bias is not None else y
    if type(weight) is Int8Weight and _int8_native(x, weight):
        y = _int8_linear(x, weight)
        return y + bias if bias is not None else y
    wide = _head_threads[0]
    if isinstance(weight, Int8Weight) and (now := torch.get_num_threads()) < wide:
        torch.set_num_threads(wide)
        try:
            return reference.linear(x, weight, bias)
        finally:
            torch.set_num_threads(now)
    return reference.linear(x, weight, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
                        pre_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As reference.add_rms_norm_linear: the native norms (the pre-norm, the residual add), then torch's GEMM."""
    if pre_norm is not None:
        x = rms_norm(x, pre_norm[0], pre_norm[1])
    normed, residual = ((rms_norm(x, norm_weight, eps), x) if residual is None
                        else fused_add_rms_norm(x, residual, norm_weight, eps))
    y = linear(normed, weight, bias)
    return (y if out_dtype is None else y.to(out_dtype)), residual


def add_rms_norm_gate_up(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         gate_up) -> tuple[torch.Tensor, torch.Tensor]:
    y, residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up)
    return silu_and_mul(y), residual


def add_rms_norm_mlp(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     gate_up, down) -> tuple[torch.Tensor, torch.Tensor]:
    y, residual = add_rms_norm_gate_up(x, residual, norm_weight, eps, gate_up)
    return linear(y, down), residual


def add_rms_norm_gate_up_gelu(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                              eps: float, gate_up, *,
                              pre_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    y, residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up, pre_norm=pre_norm)
    return gelu_tanh_and_mul(y), residual


def add_rms_norm_moe(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference: the native norm (with the residual add), then the reference's routing and experts."""
    normed, residual = ((rms_norm(x, norm_weight, eps), x) if residual is None
                        else fused_add_rms_norm(x, residual, norm_weight, eps))
    weights, ids = moe_route(normed, router, top_k, renormalize)
    return moe_experts(normed, weights, ids, gate_up, down), residual


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """As reference.rotary_write_kv (the heads' norms by the native rms_norm). q, k, v may be views of one QKV
    row [T, (Hq + 2 Hkv) D]."""
    if qk_norm is not None:
        q, k = reference.head_norms(q, k, qk_norm, rms_norm)
    t, hq, d = q.shape
    hkv = k.shape[1]
    views = all(x.stride(1) == d and x.stride(2) == 1 for x in (q, k, v))
    if not (views and _native(k_cache, v_cache) and q.dtype == k_cache.dtype == k.dtype == v.dtype
            and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and positions.dtype == torch.int64
            and slot_mapping.dtype == torch.int64 and positions.is_contiguous() and slot_mapping.is_contiguous()
            and d % 2 == 0):
        return reference.rotary_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slot_mapping)
    q_out = torch.empty(t, hq, d, dtype=q.dtype)
    slots = k_cache.numel() // (hkv * d)
    _status(_lib().rotary_write_kv(positions.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0),
                                   k.stride(0), v.stride(0), cos_sin.data_ptr(), cos_sin.shape[0], t, hq, hkv, d,
                                   _DT[q.dtype], k_cache.data_ptr(), v_cache.data_ptr(), slots,
                                   slot_mapping.data_ptr(), q_out.data_ptr()), "a position or a KV slot")
    return q_out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """As reference.paged_attention; the decode rows natively, each over its keys in place."""
    nd = meta.num_decodes
    hq, d = q.shape[1:]
    hkv = k_cache.shape[2]
    if not (nd and _native(q, k_cache, v_cache, out) and hq % hkv == 0
            and meta.block_tables.dtype == torch.int64 and meta.block_tables.is_contiguous()):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, out, window, softcap)
    assert window is None or window > 0, f"a sliding window holds at least one position, got {window}"
    out = torch.empty_like(q) if out is None else out
    lens = meta.memo.get("cpu_context_lens")
    if lens is None:
        lens = meta.memo["cpu_context_lens"] = torch.tensor(meta.context_lens_host[:nd], dtype=torch.int64)
    lib, args = _lib(), (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
                         meta.block_tables.data_ptr(), meta.block_tables.shape[1], lens.data_ptr())
    rest = (hq, hkv, d, k_cache.shape[1], scale, window or 0, softcap or 0.0, _DT[q.dtype], out.data_ptr())
    _status(_parallel(nd, lambda a, b, team, owner: lib.decode_attention(*args, a, b, *rest, team, owner)),
            "a block id or context")
    prefill_attention(q, k_cache, v_cache, meta, scale, out, window, softcap)
    return out
