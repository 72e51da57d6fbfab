"""Attention: one layer's self-attention on this rank's heads, in three steps around the paged KV cache.

`project`: (residual +) the input norm, the fused QKV projection, rotary on q and k, and this step's K/V
written into the cache. `attend`: each sequence's queries over its cached K/V (the op set's paged attention).
`output`: o_proj. A piecewise CUDA graph (workers/execute/piecewise_graphs.py) captures `project` and `output`
and runs `attend` eagerly between them, since its kernels depend on every sequence's lengths.

Under tensor parallelism QKV is column-parallel (this rank's query heads and their KV heads) and o_proj
row-parallel, all-reduced; the KV cache holds this rank's KV heads only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mii_async.kernels.metadata import AttentionMetadata

from ..parallel import TPGroup
from ..spec import ModelSpec
from ..weights import Weights
from .norm import RMSNorm

if TYPE_CHECKING:
    from mii_async.kernels.op_set import OpSet


@dataclass
class Attention:
    norm: RMSNorm                   # the layer's input norm: the QKV projection's prologue
    qkv: torch.Tensor               # [(Hq + 2 Hkv) D, H]: this rank's q heads, then k, then v
    qkv_bias: torch.Tensor | None   # [(Hq + 2 Hkv) D]
    o: torch.Tensor                 # [H, Hq D]: this rank's heads' columns
    o_bias: torch.Tensor | None     # [H], on rank 0 only: added once, before the all-reduce
    cos_sin: torch.Tensor           # [max_pos, D] fp32 rotary cache (one tensor that the layers share)
    num_heads: int                  # Hq, this rank's
    num_kv_heads: int               # Hkv, this rank's
    head_dim: int                   # D
    scale: float                    # the softmax scale
    tp: TPGroup | None

    @classmethod
    def load(cls, w: Weights, prefix: str, norm: RMSNorm, spec: ModelSpec, cos_sin: torch.Tensor,
             tp: TPGroup | None) -> Attention:
        """q_proj, k_proj, v_proj (with their biases when the checkpoint has all three) fused into one QKV, and
        o_proj, under `prefix`."""
        shard, d = w.shard, spec.head_dim
        q, kv = (shard.q_heads, shard.kv_heads) if shard is not None else (None, None)
        qkv = torch.cat([w.rows(prefix + "q_proj.weight", q, d), w.rows(prefix + "k_proj.weight", kv, d),
                         w.rows(prefix + "v_proj.weight", kv, d)], 0)
        biases = [prefix + f"{x}_proj.bias" for x in "qkv"]
        qkv_bias = (torch.cat([w.rows(biases[0], q, d), w.rows(biases[1], kv, d), w.rows(biases[2], kv, d)], 0)
                    if all(b in w for b in biases) else None)
        o_bias = prefix + "o_proj.bias"
        has_o_bias = o_bias in w and (shard is None or shard.rank == 0)
        return cls(norm, qkv, qkv_bias, w.columns(prefix + "o_proj.weight", q, d),
                   w.get(o_bias) if has_o_bias else None, cos_sin,
                   shard.num_q_heads if shard is not None else spec.num_heads,
                   shard.num_kv_heads if shard is not None else spec.num_kv_heads, d, d ** -0.5, tp)

    def project(self, ops: OpSet, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (residual None: the first layer's, which starts the residual stream) → the rotated
        q [T, Hq, D], residual + h; this step's K/V written into the cache at `slot_mapping`."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv, residual = ops.add_rms_norm_linear(h, residual, self.norm.weight, self.norm.eps, self.qkv,
                                                self.qkv_bias)                  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
        q = ops.rotary_write_kv(positions, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d),
                                self.cos_sin, k_cache, v_cache, slot_mapping)
        return q, residual

    def attend(self, ops: OpSet, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D] → [T, Hq, D] (into `out` when given), causal over each sequence's cached K/V."""
        return ops.paged_attention(q, k_cache, v_cache, meta, self.scale, out=out)

    def output(self, ops: OpSet, attn: torch.Tensor) -> torch.Tensor:
        """attn [T, Hq D] → o_proj [T, H], summed over the ranks."""
        h = ops.linear(attn, self.o, self.o_bias)
        if self.tp is not None:
            self.tp.all_reduce(h)                                               # row-parallel o_proj
        return h
