"""A mixture of experts' experts on CUDA, by the number of (token, slot) pairs a step routes:

- A few tokens (a decode step: T ≤ FEW_TOKENS): moe_gemv.cu, two kernels after the router's GEMV — the first
  chooses each token's experts from the router's logits and runs their gate and up rows with SiLU-and-mul, the
  second their down rows summed with the routing weights (where the expert FFN size is a multiple of 256, all
  the slots' rows read as one long row: more loads in flight a warp). Only the chosen experts' weights are
  read, each once, at the rate of the dense GEMV, and nothing waits on the host.
- More (prompt chunks, batched decodes): grouped GEMMs (torch._grouped_mm) over the pairs sorted by expert.
- Another dtype or card, or a torch without _grouped_mm: the reference eagerly, and inside a CUDA graph every
  expert over every token.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np
import torch

from . import reference
from .config import DEFAULT, KernelConfig
from .launch import launch as _launch, ptr as _ptr, sm_count as _sm_count

FEW_TOKENS = 2                  # tokens up to which a step takes moe_gemv.cu: the router's logits come from the
                                # dense GEMV, which takes as many rows (GEMV_MAX_M in cuda.py)
MOE_WARPS = 8                   # MOE_WARPS in moe_gemv.cu
MOE_BLOCKS_PER_SM = 2
MOE_MAX_E = 256                 # router logits one warp holds there
MOE_MAX_K = 16
MOE_SMEM = 160 << 10            # the token's xin [H], or its pairs' h [k, F], is staged in shared memory
WIDE_F = 256                    # moe_down_wide: each 32-lane slice of 16-byte chunks within one expert's row
GROUP = 256                     # 16-byte chunks a warp loads a step there (MOE_UNROLL × 32)


def few_tokens_ok(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  top_k: int) -> bool:
    """Whether moe_gemv.cu takes this step's experts: a few rows of a 16-bit type, its weights contiguous and
    16-byte aligned, hidden and expert FFN sizes whole 16-byte vectors, at most MOE_MAX_E experts and
    MOE_MAX_K a token."""
    t, h = x.shape
    e, f2, _ = gate_up.shape
    f = f2 // 2
    return (1 <= t <= FEW_TOKENS and x.dtype in (torch.bfloat16, torch.float16)
            and gate_up.dtype == down.dtype == router.dtype == x.dtype
            and h % 8 == 0 and f % 8 == 0 and down.shape == (e, h, f) and router.shape == (e, h)
            and top_k <= min(e, MOE_MAX_K) and e <= MOE_MAX_E and h * 2 <= MOE_SMEM and top_k * f * 2 <= MOE_SMEM
            and all(w.is_contiguous() and w.data_ptr() % 16 == 0 for w in (gate_up, down)))


def wide_saves_steps(f: int, top_k: int) -> bool:
    """Whether moe_down_wide takes an output row in fewer steps than moe_down: it needs F a multiple of WIDE_F,
    and reads the k slots' rows as one row of k·F/8 chunks where moe_down reads each slot's F/8 in its own steps
    (Qwen3-MoE's F = 768, k = 8: 3 steps against 8; Mixtral's F = 14336, k = 2: 14 either way)."""
    fc = f // 8
    return f % WIDE_F == 0 and -(-top_k * fc // GROUP) < top_k * -(-fc // GROUP)


def few_tokens(stream: torch.Tensor, norm_weight: torch.Tensor, eps: float, logits: torch.Tensor, top_k: int,
               renormalize: bool, gate_up: torch.Tensor, down: torch.Tensor, *, wide: bool | None = None,
               every_warp: bool = True,
               config: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts of a few tokens through moe_gemv.cu. stream [T, H]: the residual stream (the router's input
    before its RMSNorm, which the kernel repeats); logits [T, E] fp32: the router's, each rounded to the storage
    type (gemv.cu's fp32 output). `wide`: the down rows through moe_down_wide or moe_down (None: wide where it
    saves steps, `wide_saves_steps`); `every_warp`: every warp of moe_gate_up routes and starts loading at once
    (moe_gate_up_every_warp) or one warp routes for its block; each choice gives the same bits. Returns
    (out [T, H], weights [T, k] fp32, ids [T, k] int64)."""
    t, h = stream.shape
    e, f2, _ = gate_up.shape
    f, pairs = f2 // 2, t * top_k
    if wide is None:
        wide = wide_saves_steps(f, top_k)
    elif wide and f % WIDE_F:
        raise ValueError(f"wide: moe_down_wide takes an expert FFN size that is a multiple of {WIDE_F}, got {f}")
    dev = stream.device
    hidden = torch.empty((pairs, f), dtype=stream.dtype, device=dev)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    out = torch.empty((t, h), dtype=stream.dtype, device=dev)
    lanes = _sm_count() * MOE_WARPS * MOE_BLOCKS_PER_SM
    # Every warp gets the same number of rows (a remainder would leave a tail of single warps).
    per_warp = -(-pairs * f // lanes)
    _launch("moe_gemv", "moe_gate_up_every_warp" if every_warp else "moe_gate_up", stream.dtype,
            (-(-f // (per_warp * MOE_WARPS)), pairs), (MOE_WARPS * 32,),
            (_ptr(stream), np.int64(stream.stride(0)), _ptr(norm_weight.contiguous()), np.float32(eps),
             _ptr(logits), np.int32(e), np.int32(top_k), np.int32(renormalize), _ptr(gate_up), _ptr(hidden),
             _ptr(weights), _ptr(ids), np.int32(f), np.int32(h), np.int32(per_warp)),
            shared_mem=h * 2, pdl=config.pdl)
    per_warp = -(-t * h // lanes)
    _launch("moe_gemv", "moe_down_wide" if wide else "moe_down", stream.dtype,
            (-(-h // (per_warp * MOE_WARPS)), t), (MOE_WARPS * 32,),
            (_ptr(hidden), _ptr(weights), _ptr(ids), np.int32(top_k), _ptr(down), _ptr(out), np.int32(h),
             np.int32(f), np.int32(per_warp)),
            shared_mem=top_k * f * 2, pdl=config.pdl)
    return out, weights, ids


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The chosen experts of routed tokens (`ops.moe_experts`): grouped GEMMs where they run, else the
    reference (every expert over every token while a graph is captured). `act`: SiLU-and-mul."""
    if grouped_mm_ok(x, gate_up, down):
        return grouped(x, weights, ids, gate_up, down, act)
    _log_fallback(str(x.dtype), torch.cuda.get_device_capability(x.device))
    if torch.cuda.is_current_stream_capturing():
        return every_expert(x, weights, ids, gate_up, down)
    return reference.moe_experts(x, weights, ids, gate_up, down)


def grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Route → permute → grouped GEMMs → un-permute → combine, every shape fixed by T, k and E. `act`: [T k, 2F]
    → [T k, F] (SiLU-and-mul). torch._grouped_mm multiplies each expert's row group by that expert's weight
    (offsets: the groups' end rows); an expert no token chose is an empty group whose weights it never reads."""
    t, k = ids.shape
    e = gate_up.shape[0]
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)             # [T k]: pairs grouped by expert
    ends = torch.searchsorted(sorted_ids, torch.arange(1, e + 1, device=ids.device, dtype=sorted_ids.dtype),
                              out_int32=True)                                 # [E]: each group's end row
    xs = x.index_select(0, order // k)                                        # [T k, H]: each pair's token
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends)              # [T k, 2F]
    h = torch._grouped_mm(act(h), down.transpose(1, 2), offs=ends)             # [T k, H]
    y = torch.empty_like(h).index_copy_(0, order, h)                          # back in (token, slot) order
    # Σ_slot weight · y: the weights in x's dtype (as transformers' Qwen3-MoE rounds them), accumulated in fp32.
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), y.view(t, k, -1)).squeeze(1)   # [T, H]


def every_expert(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor:
    """Every expert over every token, scaled by its routing weight (zero where the token did not choose it)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        w = (weights * (ids == e)).sum(-1, keepdim=True)                      # [T, 1]
        out += reference.linear(reference.silu_and_mul(reference.linear(x, gate_up[e])), down[e]).float() * w
    return out.to(x.dtype)


@functools.cache
def _grouped_mm_device() -> bool:
    """torch._grouped_mm's own kernels: Hopper (torch ≥ 2.8), and Blackwell from torch 2.9. Elsewhere torch
    loops over the groups with their sizes read on the host."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    major = torch.cuda.get_device_capability()[0]
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return major == 9 or (major == 10 and version >= (2, 9))


def grouped_mm_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """bf16 throughout, rows of H and F a whole number of 16-byte vectors (torch._grouped_mm's strides), weights
    contiguous, and a device where it runs without the host."""
    return (x.dtype == gate_up.dtype == down.dtype == torch.bfloat16 and x.shape[1] % 8 == 0
            and down.shape[2] % 8 == 0 and gate_up.is_contiguous() and down.is_contiguous() and _grouped_mm_device())


@functools.cache
def _log_fallback(dtype: str, capability: tuple[int, int]) -> None:
    logging.getLogger("mii_async.kernels.cuda").warning(
        "mixture of experts: grouped GEMMs (torch._grouped_mm) take bf16 on Hopper, with hidden and expert FFN "
        "sizes multiples of 8; this is %s on sm_%d%d under torch %s%s, so the experts run the torch reference, "
        "and inside CUDA graphs every expert over every token", dtype, *capability, torch.__version__,
        "" if hasattr(torch, "_grouped_mm") else " (which has no torch._grouped_mm)")
