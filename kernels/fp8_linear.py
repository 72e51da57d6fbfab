"""The CUDA backend's projections over FP8 weights (fp8_weight.py's FP8Weight); kernels/cuda.py hands them every
linear-like op whose weight is one, with the same signatures as reference.py.

- A few rows (decode: M ≤ gemv_rows, at most FP8_GEMV_MAX_M): gemv_fp8.cu reads each weight byte once and widens
  it in registers, the activations in the model dtype; the residual add and RMSNorm before a projection are its
  prologue, SiLU-and-mul after gate|up its epilogue, as the bf16 gemv.cu's.
- More rows (prompt and mixed steps): the activations are quantized per token (fp8_quant.cu; the residual add
  and RMSNorm fused into it), then torch._scaled_mm multiplies e4m3 by e4m3 with per-token × per-channel scales
  into bf16. Beside block scales the activations are quantized per token and 128 columns, and _scaled_mm takes
  both 1x128 scales where this torch and cuBLAS do (checked once per device against the dequantized product,
  `blockwise_scaled_mm`, in the layout every call uses). cuBLAS (CUDA 13, H100) takes 1x128 scales over 8,
  64 or 2048 rows but refuses them over 3 or 5, so those activations are quantized into buffers of rows padded
  to a multiple of SCALED_ROW_ALIGN; a product cuBLAS still refuses sends the device to the fallback for good.
  Elsewhere the weight is dequantized a slab of rows at a time into the model dtype and multiplied by cuBLAS (a
  documented fallback: docs/quantization.md).
- Where neither applies (before sm_89, fp32 activations, widths not multiples of 16): dequantize-then-matmul.
Every path is capturable in a CUDA graph (no host sync; the one-time check never runs during a capture).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .config import DEFAULT, KernelConfig
from .fp8_weight import BLOCK_K, E4M3, FP8Weight, dequantize, quantize_activations
from .launch import launch as _launch, ptr as _ptr, sm_count as _sm_count

FP8_GEMV_MAX_M = 4              # the most rows gemv_fp8.cu is compiled for (M = 1 … 4)
# Rows up to which a projection takes the GEMV where _scaled_mm could take it instead (H100, benchmarks/fp8_gemm.py,
# docs/quantization.md): per-channel weights 2 (qkv at M = 2: 18.9 us against 25.1 for quantize + _scaled_mm;
# at M = 4 the GEMV's 31.9 loses), block scales 1 (at M = 2 the GEMV's 19.8 us loses to the 1x128 _scaled_mm's
# 12.9). Where _scaled_mm cannot take it, the alternative dequantizes the weight: the GEMV takes FP8_GEMV_MAX_M.
FP8_GEMV_ROWS = 2
FP8_GEMV_ROWS_BLOCK = 1
FP8_GEMV_WARPS = 8              # warps per block there (FP8_WARPS in gemv_fp8.cu)
FP8_GEMV_BLOCKS_PER_SM = 2
FP8_GEMV_SMEM = 160 << 10       # xin [M, K] is staged in shared memory in fp32
FP8_GEMV_RED = FP8_GEMV_WARPS * 4   # bytes per row after xin: the norm's per-warp sums (gemv_fp8.cu)
QUANT_SMEM_EXTRA = 32 * 4       # bytes after fp8_quant.cu's staged row: its block reductions' partials
SCALED_ROW_ALIGN = 16           # beside block scales, activation rows are padded to a multiple of this
DEQUANT_SLAB = 4096             # weight rows dequantized at once on the fallback path
log = logging.getLogger("mii_async.kernels.fp8")


def _aligned(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0) for t in tensors)


def gemv_rows(x: torch.Tensor, w: FP8Weight) -> int:
    """The most rows of x for which x · w takes the GEMV: the measured cut-over where _scaled_mm takes it,
    else all the GEMV is compiled for."""
    if not scaled_ok(x, w):
        return FP8_GEMV_MAX_M
    return FP8_GEMV_ROWS_BLOCK if w.blocked else FP8_GEMV_ROWS


def gemv_ok(x: torch.Tensor, w: FP8Weight, *others: torch.Tensor | None) -> bool:
    """Whether gemv_fp8.cu takes x [M, K] · w: 16-bit activations, M ≤ gemv_rows, K a whole number of
    16-byte weight chunks, xin within the shared memory, 16-byte aligned rows, `others` (bias, norm weight,
    residual) in x's dtype. The row count is checked first: a step of many rows pays one comparison."""
    m, k = x.shape
    return (1 <= m <= FP8_GEMV_MAX_M and x.dtype in (torch.bfloat16, torch.float16) and w.shape[1] == k
            and k % 16 == 0 and m * k * 4 <= FP8_GEMV_SMEM and x.stride(-1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and _aligned(w.weight)
            and all(t is None or t.dtype == x.dtype for t in others) and _aligned(*others)
            and m <= gemv_rows(x, w))


def _gemv(kind: str, x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None, config: KernelConfig,
          out_dtype: torch.dtype | None = None, residual: torch.Tensor | None = None,
          norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    m = x.shape[0]
    n, k = w.shape
    outs = n // 2 if kind == "norm_silu" else n       # [gate | up] rows → silu(gate) * up
    f32 = out_dtype == torch.float32
    y = torch.empty((m, outs), dtype=torch.float32 if f32 else x.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    # Every warp gets the same number of output rows (a remainder would leave a tail of single warps).
    per_warp = -(-outs // (_sm_count() * FP8_GEMV_WARPS * FP8_GEMV_BLOCKS_PER_SM))
    grid = -(-(-(-outs // per_warp)) // FP8_GEMV_WARPS)
    null = np.uint64(0)
    _launch("gemv_fp8", f"gemv_fp8_{kind}", x.dtype, (grid,), (FP8_GEMV_WARPS * 32,),
            (_ptr(x), np.int64(x.stride(0)), null if residual is None else _ptr(residual),
             np.int64(0 if residual is None else residual.stride(0)),
             null if norm_weight is None else _ptr(norm_weight), null if res_out is None else _ptr(res_out),
             _ptr(w.weight), _ptr(w.scale), null if bias is None else _ptr(bias), _ptr(y), np.int64(outs),
             np.int32(f32), np.int32(n), np.int32(k), np.int32(per_warp), np.float32(eps),
             np.int64(config.gemv_prefetch)),
            shared_mem=m * (k * 4 + FP8_GEMV_RED), defines=(f"FP8_M={m}", f"FP8_BLOCK={int(w.blocked)}"),
            pdl=config.pdl)
    return y, res_out


# -- many rows: quantized activations, torch._scaled_mm ------------------------------------------------------

def quantize(x: torch.Tensor, w: FP8Weight, residual: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None, eps: float = 0.0, *, silu: bool = False,
             config: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T, K] (with `norm_weight`, rms_norm(x + residual) first; with `silu`, x is [gate | up] [T, 2K] and
    silu(gate) * up is what is quantized) → (e4m3 [R, K], scales, the summed residual [T, K] or None) as `w` is
    multiplied: per token [R], or beside block scales per token and 128 columns [G, R] (transposed: _scaled_mm's
    layout), or w's static input scale [R]. R is T, or beside block scales T rounded up to SCALED_ROW_ALIGN (the
    rows past T unwritten: their products are dropped). fp8_quant.cu: one block a row."""
    t, k = x.shape
    assert x.stride(-1) == 1, f"rows must be contiguous, got strides {x.stride()}"
    assert not silu or (norm_weight is None and k % 2 == 0), "silu: [gate | up] rows, no norm"
    k = k // 2 if silu else k
    grouped = w.blocked and w.input_scale is None
    group = BLOCK_K if grouped else k
    rows = -(-t // SCALED_ROW_ALIGN) * SCALED_ROW_ALIGN if grouped else t
    q = torch.empty((rows, k), dtype=torch.uint8, device=x.device)
    scale = torch.empty((-(-k // group), rows) if grouped else (rows,), dtype=torch.float32, device=x.device)
    res_out = torch.empty((t, k), dtype=x.dtype, device=x.device) if residual is not None else None
    static = np.uint64(0) if w.input_scale is None else _ptr(w.input_scale)
    threads = min(1024, max(128, -(-k // 8) // 32 * 32))
    if t:
        if norm_weight is None:
            _launch("fp8_quant", "silu_quant_rows" if silu else "quant_rows", x.dtype, (t,), (threads,),
                    (_ptr(x), np.int64(x.stride(0)), _ptr(q), _ptr(scale), static, np.int32(k), np.int32(group),
                     np.int32(rows)), shared_mem=k * 4 + QUANT_SMEM_EXTRA, pdl=config.pdl)
        else:
            null = np.uint64(0)
            _launch("fp8_quant", "norm_quant_rows", x.dtype, (t,), (threads,),
                    (_ptr(x), np.int64(x.stride(0)), null if residual is None else _ptr(residual),
                     np.int64(0 if residual is None else residual.stride(0)), _ptr(norm_weight),
                     null if res_out is None else _ptr(res_out), _ptr(q), _ptr(scale), static, np.int32(k),
                     np.int32(group), np.int32(rows), np.float32(eps)), shared_mem=k * 4 + QUANT_SMEM_EXTRA,
                    pdl=config.pdl)
    return q.view(E4M3), scale, res_out


def scaled_ok(x: torch.Tensor, w: FP8Weight) -> bool:
    """torch._scaled_mm takes it: e4m3 GEMMs (sm_89 or later), N and K multiples of 16, 16-bit activations; and
    beside block scales, _scaled_mm's own 1x128 scaling (else the dequantizing fallback)."""
    n, k = w.shape
    return (x.dtype in (torch.bfloat16, torch.float16) and n % 16 == 0 and k % 16 == 0 and _fp8_gemm(x.device)
            and (not w.blocked or (w.input_scale is None and blockwise_scaled_mm(x.device))))


def scaled_linear(q: torch.Tensor, scale: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """e4m3 activations [T, K] with their scales (quantize's) · w → [T, N] in `out_dtype`, in fp32 sums. Also
    runs on the CPU, where torch implements _scaled_mm (the tests check the scale layouts there)."""
    if w.blocked:       # 1x128 both: scale_a [T, G] strides (1, T), scale_b [G, N] contiguous
        y = torch._scaled_mm(q, w.weight.t(), scale_a=scale.t(), scale_b=w.scale.t(), out_dtype=torch.bfloat16)
    else:
        y = torch._scaled_mm(q, w.weight.t(), scale_a=scale[:, None], scale_b=w.scale[None, :],
                             out_dtype=torch.bfloat16)
    y = y if out_dtype == torch.bfloat16 else y.to(out_dtype)
    return y if bias is None else y.add_(bias)


@functools.cache
def _fp8_gemm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(torch, "_scaled_mm")


_blockwise: dict[int, bool] = {}


def _scaled_rows(q: torch.Tensor, scale: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, t: int) -> torch.Tensor | None:
    """scaled_linear's first t rows; None where cuBLAS refuses this block-scaled product (it says so before
    launching anything, so a capture in progress is unharmed): the device is then marked as taking no 1x128
    scales, and the caller and every later call take the dequantizing fallback."""
    try:
        return scaled_linear(q, scale, w, bias, out_dtype)[:t]
    except RuntimeError as exc:
        if not w.blocked:
            raise
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        _blockwise[index] = False
        log.warning("FP8 block scales: torch._scaled_mm refused %s x %s with 1x128 scales (%s); prompt steps "
                    "dequantize the weights from here on", tuple(q.shape), tuple(w.shape),
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def blockwise_scaled_mm(device: torch.device) -> bool:
    """Whether this torch multiplies e4m3 by e4m3 with 1x128 scales on both sides (per token and 128 columns ×
    per row and 128 columns) on this device, matching the dequantized product: tried once per device, outside
    any graph capture (before the first, every capture uses the fallback)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _blockwise:
        if torch.cuda.is_current_stream_capturing():
            return False
        _blockwise[index] = _try_blockwise(torch.device("cuda", index))
    return _blockwise[index]


def _try_blockwise(device: torch.device) -> bool:
    from .fp8_weight import quantize_blocks, block_rows

    # The layouts of a real call: 5 rows padded to SCALED_ROW_ALIGN (zeros past them), a partial last block.
    g = torch.Generator(device=device).manual_seed(0)
    t, k = 5, 336
    x = torch.zeros(SCALED_ROW_ALIGN, k, device=device, dtype=torch.bfloat16)
    x[:t] = torch.randn(t, k, device=device, generator=g).to(torch.bfloat16)
    wq, blocks = quantize_blocks(torch.randn(256, k, device=device, generator=g))
    w = FP8Weight(wq, block_rows(blocks, 0, 256))
    q, sx = quantize_activations(x, BLOCK_K)
    try:
        y = scaled_linear(q, sx.t().contiguous(), w, None, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        log.info("FP8 block scales: torch._scaled_mm takes no 1x128 scales here (%s); prompt steps dequantize "
                 "the weights a slab at a time", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    ref = (dequantize(q, sx) @ w.dequantize(torch.float32).t())[:t]
    err = ((y[:t].float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        log.warning("FP8 block scales: torch._scaled_mm with 1x128 scales is %.3g off the dequantized product "
                    "here; prompt steps dequantize the weights instead", err)
        return False
    return True


def dense_linear(x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x · dequantize(w)ᵀ in x's dtype (the reference's numbers), DEQUANT_SLAB weight rows at a time, so that
    the model dtype's copy of a weight never exists whole."""
    n = w.shape[0]
    if n <= DEQUANT_SLAB:
        return F.linear(x, w.dequantize(x.dtype), bias)
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    for a in range(0, n, DEQUANT_SLAB):
        b = min(n, a + DEQUANT_SLAB)
        wd = dequantize(w.weight[a:b], w.scale[a:b]).to(x.dtype)
        y[:, a:b] = F.linear(x, wd, None if bias is None else bias[a:b])
    return y


# -- the op set's entries --------------------------------------------------------------------------------------

def linear(x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None = None, *,
           config: KernelConfig = DEFAULT) -> torch.Tensor:
    if gemv_ok(x, w, bias):
        return _gemv("plain", x, w, bias, config)[0]
    if scaled_ok(x, w):
        q, scale, _ = quantize(x.contiguous(), w, config=config)
        y = _scaled_rows(q, scale, w, bias, x.dtype, x.shape[0])
        if y is not None:
            return y
    return dense_linear(x, w, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        w: FP8Weight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                        *, norm: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                        config: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference. A few rows: one gemv_fp8.cu kernel, the norm its prologue. More: the norm fused into
    the activations' quantization, then _scaled_mm. `norm(x, residual)`: the op set's (residual +) RMSNorm, for
    the dequantizing fallback."""
    if out_dtype in (None, x.dtype, torch.float32) and gemv_ok(x, w, bias, norm_weight, residual) and \
            (residual is None or residual.shape == x.shape):
        y, res_out = _gemv("norm", x, w, bias, config, out_dtype, residual, norm_weight, eps)
        return y, x if res_out is None else res_out
    if scaled_ok(x, w) and x.is_contiguous() and (residual is None or residual.is_contiguous()):
        q, scale, res_out = quantize(x, w, residual, norm_weight, eps, config=config)
        y = _scaled_rows(q, scale, w, bias, out_dtype or x.dtype, x.shape[0])
        if y is not None:
            return y, x if res_out is None else res_out
    normed, residual = norm(x, residual)
    y = dense_linear(normed, w, bias)
    return (y if out_dtype is None else y.to(out_dtype)), residual


def silu_linear(y: torch.Tensor, w: FP8Weight, *, config: KernelConfig = DEFAULT) -> torch.Tensor | None:
    """(silu(gate) * up) · w for y = [gate | up] [T, 2F], SiLU-and-mul the activations' quantization
    (silu_quant_rows), then _scaled_mm; None where those do not take it (the caller then runs SiLU-and-mul and
    `linear`)."""
    if not (scaled_ok(y, w) and y.is_contiguous() and y.shape[1] == 2 * w.shape[1]):
        return None
    q, scale, _ = quantize(y, w, silu=True, config=config)
    return _scaled_rows(q, scale, w, None, y.dtype, y.shape[0])


def add_rms_norm_gate_up(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         gate_up: FP8Weight, *, norm: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                         act: Callable[[torch.Tensor], torch.Tensor],
                         config: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference. A few rows: one gemv_fp8.cu kernel, the norm its prologue, SiLU-and-mul (`act`) its
    epilogue. More: add_rms_norm_linear, then `act`."""
    if gate_up.shape[0] % 2 == 0 and gemv_ok(x, gate_up, norm_weight, residual) and \
            (residual is None or residual.shape == x.shape):
        y, res_out = _gemv("norm_silu", x, gate_up, None, config, None, residual, norm_weight, eps)
        return y, x if res_out is None else res_out
    y, residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up, norm=norm, config=config)
    return act(y), residual
