"""CuPy/CUDA backend of the op set: the same signatures as reference.py, on torch CUDA tensors.

Kernels are compiled from csrc/*.cu by CuPy (NVRTC, `-arch=sm_90` on Hopper, the device's own arch
elsewhere) once per process, and CuPy keeps the binaries in its on-disk cache (~/.cupy/kernel_cache), so
later processes load them without compiling. Every launch goes on torch's current stream (an ExternalStream
over its handle), so that kernels order with torch's own work and are captured by torch.cuda.CUDAGraph; while
a graph is captured on Hopper, through programmatic dependent launch (pdl.py), so that in a decode step's chain
each kernel's start overlaps the previous one's tail.
Prompt chunks go through torch's variable-length flash attention, all chunks of a step in one call per layer
(prefill_attention.py); the standalone rotary and KV write, and decode shapes the kernel does not handle
(`decode_supported`), run the torch reference on the GPU. A mixture of experts' experts (cuda_moe.py) run
through moe_gemv.cu for a few tokens and as grouped GEMMs over the tokens sorted by expert beyond. A
projection whose weight is FP8 (fp8_weight.py) goes to fp8_linear.py: an FP8 GEMV of a few rows,
torch._scaled_mm beyond. An FP8 KV cache (kv_store.py) is written by the rotary kernel and read by the decode
kernels compiled for it (MII_KV_FP8); prompt chunks widen what they gather.
The ops in CONFIGURED take the KernelConfig (config.py) as `config=`; get_ops("cuda", config) binds it.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from . import cuda_moe, fp8_linear, reference
from .config import DEFAULT, KernelConfig
from .decode_attention import decode_supported, paged_attention_decode  # noqa: F401 (the op set)
from .fp8_weight import FP8Weight
from .kv_store import FP8_KV
from .launch import launch as _launch, ptr as _ptr, sm_count as _sm_count
from .metadata import AttentionMetadata
from .prefill_attention import prefill_attention  # noqa: F401 (the op set)

RAGGED_PREFILL = True           # takes AttentionMetadata.prefill_groups (the runner builds them)
CONFIGURED = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "linear", "add_rms_norm_linear",
              "add_rms_norm_gate_up", "add_rms_norm_mlp", "add_rms_norm_gate_up_gelu", "gelu_tanh_and_mul",
              "rotary_write_kv",
              "paged_attention", "paged_attention_decode", "moe_experts", "add_rms_norm_moe")

rotary_embedding = reference.rotary_embedding
write_kv = reference.write_kv


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, config: KernelConfig = DEFAULT) -> torch.Tensor:
    t, stride = _rows(x)
    h = x.shape[1]
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    weight = weight.contiguous()
    vec = _vec(h, (stride,), x, weight)
    if t:
        _launch("norms", "rms_norm", x.dtype, (t,), (_threads(h // (16 // x.element_size() if vec else 4)),),
                (_ptr(x), _ptr(weight), _ptr(out), np.int32(h), np.int64(stride), np.float32(eps), np.int32(vec)),
                shared_mem=h * 4, pdl=config.pdl)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       config: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
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
                 np.int64(xs), np.int64(rs), np.float32(eps), np.int32(vec)), shared_mem=h * 4, pdl=config.pdl)
    return out, res


def silu_and_mul(x: torch.Tensor, *, config: KernelConfig = DEFAULT) -> torch.Tensor:
    t, stride = _rows(x)
    f = x.shape[1] // 2
    out = torch.empty((t, f), dtype=x.dtype, device=x.device)
    vec = _vec(f, (stride,), x)
    if t:
        threads = 256
        per_thread = 16 // x.element_size() if vec else 1
        _launch("activation", "silu_and_mul", x.dtype, (min(-(-f // (threads * per_thread)), 64), t), (threads,),
                (_ptr(x), _ptr(out), np.int32(f), np.int64(stride), np.int32(vec)), pdl=config.pdl)
    return out


ROTARY_NORM_WARPS = 8           # heads a block of rotary_norm_write_kv takes, a warp each

GEMV_MAX_M = 2                  # rows up to which the projections take gemv.cu (instantiated for 1 and 2; at 3
                                # and 4 rows cuBLAS was as fast or faster on the H200)
GEMV_WARPS = 8                  # warps per block there (GEMV_WARPS in gemv.cu)
GEMV_BLOCKS_PER_SM = 2
GEMV_SMEM = 160 << 10           # xin [M, K] is staged in shared memory


def _aligned(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0) for t in tensors)


def _gemv_ok(x: torch.Tensor, weight: torch.Tensor, k: int, *others: torch.Tensor | None) -> bool:
    """Whether gemv.cu takes x [M, ·] · weight [N, k]ᵀ: 16-bit types, M ≤ GEMV_MAX_M, k a whole number of
    16-byte chunks, 16-byte aligned rows. The row count is checked first, so that a step of many rows pays one
    comparison per projection."""
    m = x.shape[0]
    return (1 <= m <= GEMV_MAX_M and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.shape[1] == k and k % 8 == 0 and m * k * 2 <= GEMV_SMEM
            and x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and _aligned(weight)
            and all(t is None or t.dtype == x.dtype for t in others) and _aligned(*others))


def _gemv(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: KernelConfig,
          out_dtype: torch.dtype | None = None, residual: torch.Tensor | None = None,
          norm_weight: torch.Tensor | None = None, eps: float = 0.0,
          pre_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    m = x.shape[0]
    n, k = weight.shape
    outs = n // 2 if kind in ("norm_silu", "norm_gelu") else n      # [gate | up] rows → act(gate) * up
    f32 = out_dtype == torch.float32
    y = torch.empty((m, outs), dtype=torch.float32 if f32 else x.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    # Every warp gets the same number of output rows (a remainder would leave a tail of single warps).
    per_warp = -(-outs // (_sm_count() * GEMV_WARPS * GEMV_BLOCKS_PER_SM))
    grid = -(-(-(-outs // per_warp)) // GEMV_WARPS)
    null = np.uint64(0)
    _launch("gemv", f"gemv_{kind}_m{m}", x.dtype, (grid,), (GEMV_WARPS * 32,),
            (_ptr(x), np.int64(x.stride(0)), null if residual is None else _ptr(residual),
             np.int64(0 if residual is None else residual.stride(0)),
             null if norm_weight is None else _ptr(norm_weight),
             null if res_out is None else _ptr(res_out), _ptr(weight), null if bias is None else _ptr(bias), _ptr(y),
             np.int64(outs), np.int32(f32), np.int32(n), np.int32(k), np.int32(per_warp), np.float32(eps),
             null if pre_norm is None else _ptr(pre_norm[0]), np.float32(0.0 if pre_norm is None else pre_norm[1]),
             np.int64(config.gemv_prefetch)),
            shared_mem=m * k * 2, pdl=config.pdl)
    return y, res_out


def linear(x: torch.Tensor, weight: torch.Tensor | FP8Weight, bias: torch.Tensor | None = None, *,
           config: KernelConfig = DEFAULT) -> torch.Tensor:
    if isinstance(weight, FP8Weight):
        return fp8_linear.linear(x, weight, bias, config=config)
    if _gemv_ok(x, weight, x.shape[1], bias):
        return _gemv("plain", x, weight, bias, config)[0]
    return F.linear(x, weight, bias)


def _norm_gemv_ok(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    return (_gemv_ok(x, weight, x.shape[1], bias, norm_weight, residual)
            and (residual is None or residual.shape == x.shape))


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor | FP8Weight, bias: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None, *, pre_norm: tuple[torch.Tensor, float] | None = None,
                        config: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference. A few rows take one gemv.cu kernel: the norm (and a `pre_norm` of x, with a residual)
    is its prologue. An FP8 weight: fp8_linear.py."""
    if pre_norm is not None:
        if _pre_norm_gemv_ok(x, residual, pre_norm, weight) and out_dtype in (None, x.dtype, torch.float32) \
                and _norm_gemv_ok(x, residual, norm_weight, weight, bias):
            return _gemv("norm", x, weight, bias, config, out_dtype, residual, norm_weight, eps, pre_norm)
        x = rms_norm(x, pre_norm[0], pre_norm[1], config=config)
    if isinstance(weight, FP8Weight):
        return fp8_linear.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias, out_dtype,
                                              norm=functools.partial(_norm, norm_weight, eps, config), config=config)
    if out_dtype in (None, x.dtype, torch.float32) and _norm_gemv_ok(x, residual, norm_weight, weight, bias):
        y, res_out = _gemv("norm", x, weight, bias, config, out_dtype, residual, norm_weight, eps)
        return y, x if res_out is None else res_out
    if residual is None:
        normed, residual = rms_norm(x, norm_weight, eps, config=config), x
    else:
        normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps, config=config)
    y = F.linear(normed, weight, bias)
    return (y if out_dtype is None else y.to(out_dtype)), residual


def add_rms_norm_gate_up(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         gate_up: torch.Tensor | FP8Weight, *,
                         config: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference. A few rows take one gemv.cu kernel: the norm is its prologue, SiLU-and-mul its
    epilogue (a warp computes a gate row and its up row). An FP8 weight: fp8_linear.py."""
    if isinstance(gate_up, FP8Weight):
        return fp8_linear.add_rms_norm_gate_up(x, residual, norm_weight, eps, gate_up,
                                               norm=functools.partial(_norm, norm_weight, eps, config),
                                               act=functools.partial(silu_and_mul, config=config), config=config)
    if gate_up.shape[0] % 2 == 0 and _norm_gemv_ok(x, residual, norm_weight, gate_up):
        y, res_out = _gemv("norm_silu", x, gate_up, None, config, None, residual, norm_weight, eps)
        return y, x if res_out is None else res_out
    y, residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up, config=config)
    return silu_and_mul(y, config=config), residual


def add_rms_norm_mlp(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     gate_up: torch.Tensor | FP8Weight, down: torch.Tensor | FP8Weight, *,
                     config: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference. FP8 projections over more rows than their GEMV takes: silu(gate) * up is the down
    projection's activation quantization (fp8_linear.silu_linear), never written in the model dtype. Otherwise
    add_rms_norm_gate_up (at a few rows, its GEMV with SiLU-and-mul as epilogue), then linear."""
    if isinstance(gate_up, FP8Weight) and isinstance(down, FP8Weight) and gate_up.shape[0] == 2 * down.shape[1] \
            and not fp8_linear.gemv_ok(x, gate_up, norm_weight, residual):
        y, residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up, config=config)   # [gate | up]
        out = None
        if not fp8_linear.gemv_ok(y[:, :down.shape[1]], down):     # (down's GEMV may take more rows than gate_up's)
            out = fp8_linear.silu_linear(y, down, config=config)
        if out is None:
            out = linear(silu_and_mul(y, config=config), down, config=config)
        return out, residual
    y, residual = add_rms_norm_gate_up(x, residual, norm_weight, eps, gate_up, config=config)
    return linear(y, down, config=config), residual


def _pre_norm_gemv_ok(x: torch.Tensor, residual: torch.Tensor | None, pre_norm: tuple[torch.Tensor, float],
                      weight: torch.Tensor | FP8Weight) -> bool:
    """Whether gemv.cu can norm x itself first: a 16-bit weight, a residual to add it to (the kernel writes the
    sum), and the pre-norm's weight in x's dtype, aligned."""
    return (not isinstance(weight, FP8Weight) and residual is not None and pre_norm[0].dtype == x.dtype
            and pre_norm[0].is_contiguous() and pre_norm[0].numel() == x.shape[1] and _aligned(pre_norm[0]))


def _norm(norm_weight: torch.Tensor, eps: float, config: KernelConfig, x: torch.Tensor,
          residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual +) RMSNorm → (normed, the residual stream): the prologue of a projection, as its own kernel."""
    if residual is None:
        return rms_norm(x, norm_weight, eps, config=config), x
    return fused_add_rms_norm(x, residual, norm_weight, eps, config=config)


def gelu_tanh_and_mul(x: torch.Tensor, *, config: KernelConfig = DEFAULT) -> torch.Tensor:
    """As the reference: torch's elementwise kernels (GeGLU sits beside a GEMM that dwarfs it)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def add_rms_norm_gate_up_gelu(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                              eps: float, gate_up: torch.Tensor, *, pre_norm: tuple[torch.Tensor, float] | None = None,
                              config: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference. A few rows take one gemv.cu kernel: the norm (and a `pre_norm` of x, with a residual)
    is its prologue, GeGLU its epilogue. More: the norm and the projection as add_rms_norm_linear takes them,
    then GeGLU."""
    if isinstance(gate_up, torch.Tensor) and gate_up.shape[0] % 2 == 0 \
            and _norm_gemv_ok(x, residual, norm_weight, gate_up) \
            and (pre_norm is None or _pre_norm_gemv_ok(x, residual, pre_norm, gate_up)):
        y, res_out = _gemv("norm_gelu", x, gate_up, None, config, None, residual, norm_weight, eps, pre_norm)
        return y, x if res_out is None else res_out
    y, residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up, pre_norm=pre_norm, config=config)
    return gelu_tanh_and_mul(y, config=config), residual


moe_route = reference.moe_route     # a GEMV of E rows, softmax and top-k: torch's kernels, no host sync


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, *, config: KernelConfig = DEFAULT) -> torch.Tensor:
    """As the reference: grouped GEMMs over the pairs sorted by expert in bf16 on Hopper, only the chosen
    experts' weights read and nothing waiting on the host (cuda_moe.py)."""
    return cuda_moe.experts(x, weights, ids, gate_up, down, functools.partial(silu_and_mul, config=config))


def add_rms_norm_moe(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, renormalize: bool,
                     *, config: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference. A few tokens: the router's GEMV with the norm its prologue, then moe_gemv.cu's two
    kernels (cuda_moe.few_tokens: three launches for the layer). More: the norm, routing, and grouped GEMMs."""
    if cuda_moe.few_tokens_ok(x, router, gate_up, down, top_k) and _norm_gemv_ok(x, residual, norm_weight, router):
        logits, res_out = _gemv("norm", x, router, None, config, torch.float32, residual, norm_weight, eps)
        stream = x if res_out is None else res_out
        return cuda_moe.few_tokens(stream, norm_weight, eps, logits, top_k, renormalize, gate_up, down,
                                   config=config)[0], stream
    normed, residual = _norm(norm_weight, eps, config, x, residual)
    weights, ids = moe_route(normed, router, top_k, renormalize)
    return moe_experts(normed, weights, ids, gate_up, down, config=config), residual


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, *,
                    config: KernelConfig = DEFAULT) -> torch.Tensor:
    """As the reference, in one kernel; with `qk_norm` in 16-bit types and a head size of 16 · 2^n up to 256,
    the heads' norms are that kernel's prologue (rotary_norm_write_kv), else kernels of their own first."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    fused = qk_norm is not None and q.dtype != torch.float32 and d in (16, 32, 64, 128, 256)
    if qk_norm is not None and not fused:
        q, k = reference.head_norms(q, k, qk_norm, functools.partial(rms_norm, config=config))
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert x.stride(2) == 1 and x.stride(1) == d, f"{name}: heads must be contiguous, got strides {x.stride()}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype in (q.dtype, FP8_KV)
    defines = ("MII_KV_FP8",) if k_cache.dtype == FP8_KV else ()
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if not t:
        return q_out
    args = (_ptr(positions.contiguous()), _ptr(q), _ptr(k), _ptr(v), _ptr(cos_sin), _ptr(q_out), _ptr(k_cache),
            _ptr(v_cache), _ptr(slot_mapping.contiguous()), np.int32(hq), np.int32(hkv), np.int32(d),
            np.int64(q.stride(0)), np.int64(k.stride(0)), np.int64(v.stride(0)))
    if fused:
        warps = min(ROTARY_NORM_WARPS, hq + hkv)                 # a warp a head
        _launch("rotary_kv", "rotary_norm_write_kv", q.dtype, (t, -(-(hq + hkv) // warps)), (32 * warps,),
                (*args, _ptr(qk_norm[0].contiguous()), _ptr(qk_norm[1].contiguous()), np.float32(qk_norm[2])),
                defines=defines, pdl=config.pdl)
    else:
        _launch("rotary_kv", "rotary_write_kv", q.dtype, (t,), (_threads(max(hq, hkv) * d // 2),), args,
                defines=defines, pdl=config.pdl)
    return q_out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                    window: int | None = None, softcap: float | None = None, *,
                    config: KernelConfig = DEFAULT) -> torch.Tensor:
    """As reference.paged_attention: decodes through paged_attention_decode (as `config` chooses), prompt
    chunks through torch's variable-length flash attention (prefill_attention.py); both within the layer's
    sliding `window` and with its `softcap` where it has them."""
    nd = meta.num_decodes
    q = q.contiguous()
    if nd and not decode_supported(q.shape[1], k_cache.shape[2], q.shape[2]):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, out, window, softcap)
    out = torch.empty_like(q) if out is None else out
    if nd:
        paged_attention_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd],
                               max(meta.context_lens_host[:nd]), scale, out=out[:nd], window=window,
                               softcap=softcap, config=config)
    if nd < len(meta.query_lens):
        prefill_attention(q, k_cache, v_cache, meta, scale, out, window, softcap, kernel=config.prefill_attention)
    return out
