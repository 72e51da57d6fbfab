"""Reading and writing the paged KV cache in its own dtype: the model's, or e4m3 (`kv_cache_dtype="fp8"`).

An FP8 cache holds K and V as e4m3 with a scale of 1 (values past ±448 saturate; a K or V element of a trained
model is far smaller), half the bytes of bf16. torch's CPU kernels do not index float8 tensors, so blocks are
copied through a uint8 view of the same bytes; readers widen what they gathered to their compute dtype.
"""
from __future__ import annotations

import torch

FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype of CacheConfig.kv_cache_dtype ("auto": the model's)."""
    return FP8_KV if name == "fp8" else model_dtype


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.dtype == FP8_KV else cache


def select_blocks(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, Hkv, D] at block ids `index` (1-D) → [len(index), bs, Hkv, D] in the cache's dtype."""
    n = cache.shape[0]
    rows = torch.index_select(_bytes(cache).view(n, -1), 0, index).view(cache.dtype)
    return rows.view(-1, *cache.shape[1:])


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, Hkv, D] written into cache [N, bs, Hkv, D] at flat slots [T] (in place), in the cache's dtype."""
    n, bs, h, d = cache.shape
    if cache.dtype == FP8_KV:
        x = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV).view(torch.uint8)
    else:
        x = x.to(cache.dtype)
    _bytes(cache).view(n * bs, h, d).index_copy_(0, slots, x)


def gather(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [N, bs, Hkv, D] at flat slots `index` (1-D) → [len(index), Hkv, D] in `dtype` (widened from e4m3
    where the cache is FP8)."""
    n, bs, h, d = cache.shape
    rows = torch.index_select(_bytes(cache).view(n * bs, h, d), 0, index)
    return rows.view(cache.dtype).to(dtype) if cache.dtype == FP8_KV else rows.to(dtype)
