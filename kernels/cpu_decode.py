"""DecodeLayers: a CPU decode step's layers in one native call (csrc/cpu/decode_layers.c).

Op by op, a step of the default model (SmolLM2-135M, 30 layers, batch 1) is about 300 calls from Python into
C, each with its checks, allocations and argument conversions: a third of the step once the ops themselves were
native. Here the model hands over its layers once (workers/model/decoder.py builds the FusedLayer list where
every layer is the plain pre-norm block with int4 weights in the native layout), and each one-thread decode step
runs them in one call, through the same C functions in the same order: the numbers are the op-by-op step's.

Where it runs: bf16 activations and caches, decode rows only, a step on one thread (the engine's batch-1
policy, workers/cpu_plan.py; steps on more threads split each op over them instead). Anything else takes the
op-by-op path.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from .cpu_build import load
from .cpu_int4 import NativeInt4Weight
from .metadata import AttentionMetadata

P = ctypes.c_void_p


class FusedLayer(NamedTuple):
    attn_norm: torch.Tensor         # [H] bf16
    mlp_norm: torch.Tensor          # [H] bf16
    qkv: NativeInt4Weight           # [(Hq + 2 Hkv) D, H]
    o: NativeInt4Weight             # [H, Hq D]
    gate_up: NativeInt4Weight       # [2 F, H]
    down: NativeInt4Weight          # [H, F]
    k_cache: torch.Tensor           # [N, bs, Hkv, D] bf16
    v_cache: torch.Tensor
    cos_sin: torch.Tensor           # [P, D] fp32
    window: int | None


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", P), ("mlp_norm", P), ("qkv", P), ("qkv_sz", P), ("o", P), ("o_sz", P),
                ("gate_up", P), ("gate_up_sz", P), ("down", P), ("down_sz", P), ("k_cache", P), ("v_cache", P),
                ("cos_sin", P), ("window", ctypes.c_int64)]


class _Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("L", "H", "Hq", "Hkv", "D", "F", "bs", "gelu")] + \
               [(name, ctypes.c_float) for name in ("eps", "scale", "softcap")] + \
               [("P", ctypes.c_int64), ("N", ctypes.c_int64)]


class DecodeLayers:
    def __init__(self, layers: list[FusedLayer], eps: float, scale: float, softcap: float | None, gelu: bool) -> None:
        first = layers[0]
        n_blocks, bs, hkv, d = first.k_cache.shape
        hidden = first.o.shape[0]
        self.layers = layers                        # holds every tensor the structs point into
        self.hidden = hidden
        self.shape = _Shape(len(layers), hidden, first.o.shape[1] // d, hkv, d, first.down.shape[1], bs, int(gelu),
                            eps, scale, softcap or 0.0, first.cos_sin.shape[0], n_blocks)
        self.structs = (_Layer * len(layers))(*(
            _Layer(y.attn_norm.data_ptr(), y.mlp_norm.data_ptr(), y.qkv.codes.data_ptr(),
                   y.qkv.scale_zeros.data_ptr(), y.o.codes.data_ptr(), y.o.scale_zeros.data_ptr(),
                   y.gate_up.codes.data_ptr(), y.gate_up.scale_zeros.data_ptr(), y.down.codes.data_ptr(),
                   y.down.scale_zeros.data_ptr(), y.k_cache.data_ptr(), y.v_cache.data_ptr(),
                   y.cos_sin.data_ptr(), y.window or 0) for y in layers))
        self._fn = load().decode_layers

    def runs(self, h: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one it runs: decode rows only, one thread, bf16 rows."""
        return (meta.num_decodes == h.shape[0] and torch.get_num_threads() == 1 and h.dtype == torch.bfloat16
                and h.is_contiguous() and meta.block_tables.dtype == torch.int64
                and meta.block_tables.is_contiguous())

    def __call__(self, h: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (the embeddings) → the last layer's output and the residual stream, [T, H] each."""
        t = h.shape[0]
        h = h.clone()
        residual = torch.empty_like(h)
        lens = meta.memo.get("cpu_context_lens")
        if lens is None:
            lens = meta.memo["cpu_context_lens"] = torch.tensor(meta.context_lens_host[:t], dtype=torch.int64)
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        rc = self._fn(self.structs, ctypes.byref(self.shape), t, positions.data_ptr(), slots.data_ptr(),
                      meta.block_tables.data_ptr(), meta.block_tables.shape[1], lens.data_ptr(), h.data_ptr(),
                      residual.data_ptr())
        if rc == -1:
            raise MemoryError("the CPU decode step could not allocate its scratch memory")
        if rc:
            raise IndexError("a position, KV slot, block id or context length out of range")
        return h, residual


def decode_layers(layers: list[FusedLayer], eps: float, scale: float, softcap: float | None,
                  gelu: bool) -> DecodeLayers | None:
    """The fused step over `layers`, or None where the native library cannot run them (no AVX512-BF16 build, a
    tensor not in the layout or dtype the C code reads, shapes that differ between layers)."""
    lib = load()
    if lib is None or not lib.int4_gemm_native() or not layers:
        return None
    first = layers[0]
    d, hkv = first.k_cache.shape[-1], first.k_cache.shape[-2]
    hidden, hq = first.o.shape[0], first.o.shape[1] // d
    if not (first.qkv.shape == (hq * d + 2 * hkv * d, hidden) and first.o.shape[1] == hq * d and d % 2 == 0
            and hq % hkv == 0 and first.gate_up.shape == (2 * first.down.shape[1], hidden)
            and first.down.shape[0] == hidden and first.cos_sin.shape[1] == d):
        return None
    for y in layers:
        tensors = (y.attn_norm, y.mlp_norm, y.k_cache, y.v_cache)
        if not (all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.is_cpu for t in tensors)
                and y.cos_sin.dtype == torch.float32 and y.cos_sin.is_contiguous()
                and all(type(w) is NativeInt4Weight for w in (y.qkv, y.o, y.gate_up, y.down))
                and y.k_cache.shape == first.k_cache.shape == y.v_cache.shape
                and y.cos_sin.shape == first.cos_sin.shape
                and all(a.shape == b.shape for a, b in zip((y.qkv, y.o, y.gate_up, y.down),
                                                            (first.qkv, first.o, first.gate_up, first.down)))):
            return None
    return DecodeLayers(layers, eps, scale, softcap, gelu)
