"""Attention: one layer's self-attention on this rank's heads, in three steps around the paged KV cache.

`project`: (residual +) the input norm, the fused QKV projection, per-head RMSNorm on q and k where the
architecture has it (Qwen3, Gemma 3), rotary on q and k, and this step's K/V written into the cache. `attend`:
each sequence's queries over its cached K/V (the op set's paged attention), within the layer's sliding window
and with its logit soft-cap where it has them. `output`: o_proj. A piecewise CUDA graph
(workers/execute/piecewise_graphs.py) captures `project` and `output` and runs `attend` eagerly between them,
since its kernels depend on every sequence's lengths.

The checkpoint's q_proj, k_proj and v_proj, or its fused qkv_proj (Phi-3), become one QKV. With partial rotary
(rotary_dim < head_dim) the q and k rows of each head are reordered at load so that the rotated dims pair up
as a whole-head rotate-half does (`rotary_order`) and the others meet a zero frequency: one rotary kernel for
both, and q·k is unchanged, since q and k take the same order.

Under tensor parallelism QKV is column-parallel (this rank's query heads and their KV heads) and o_proj
row-parallel, all-reduced; the KV cache holds this rank's KV heads only. Under FP8 weights QKV and o_proj are
FP8Weights (their scales' rows taken and reordered with the weights' rows), which the op set takes as it takes
a dense weight. With an FP8 KV cache, a checkpoint's calibrated K/V scales fold into these weights
(kv_scales.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mii_async.kernels.metadata import AttentionMetadata

from ..kv_scales import fold_kv_scales, read_kv_scales
from ..quantized_loading import LinearWeight, map_rows
from ..parallel import TPGroup
from ..spec import ModelSpec
from ..weights import Weights
from .norm import RMSNorm

if TYPE_CHECKING:
    from mii_async.kernels.op_set import OpSet


@dataclass
class Attention:
    norm: RMSNorm                   # the layer's input norm: the QKV projection's prologue
    qkv: LinearWeight               # [(Hq + 2 Hkv) D, H]: this rank's q heads, then k, then v (or FP8)
    qkv_bias: torch.Tensor | None   # [(Hq + 2 Hkv) D]
    o: LinearWeight                 # [H, Hq D]: this rank's heads' columns (or FP8)
    o_bias: torch.Tensor | None     # [H], on rank 0 only: added once, before the all-reduce
    cos_sin: torch.Tensor           # [max_pos, D] fp32 rotary cache (one tensor that the layers share)
    num_heads: int                  # Hq, this rank's
    num_kv_heads: int               # Hkv, this rank's
    head_dim: int                   # D
    scale: float                    # the softmax scale
    tp: TPGroup | None
    q_norm: RMSNorm | None = None   # [D] RMSNorm of each q head before rotary (Qwen3, Gemma 3)
    k_norm: RMSNorm | None = None   # [D] the same of each k head
    window: int | None = None       # sliding window: a query attends to the last `window` positions, itself
                                    # included; None: to the whole context
    softcap: float | None = None    # scores → softcap·tanh(score / softcap) before the softmax (Gemma 2)

    @classmethod
    def load(cls, w: Weights, prefix: str, norm: RMSNorm, spec: ModelSpec, cos_sin: torch.Tensor,
             tp: TPGroup | None, *, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
             window: int | None = None) -> Attention:
        """q_proj, k_proj, v_proj (with their biases when the checkpoint has all three), or one fused qkv_proj,
        as one QKV, and o_proj, under `prefix`. `q_norm`, `k_norm`: the per-head norms of q and k; `window`: the
        layer's sliding window (spec.window_of). The softmax scale and the soft-cap are the spec's."""
        shard, d = w.shard, spec.head_dim
        hq, hkv = spec.num_heads, spec.num_kv_heads
        q, kv = (shard.q_heads, shard.kv_heads) if shard is not None else ((0, hq), (0, hkv))
        fused = prefix + "qkv_proj.weight"
        if fused in w:                  # [q heads | k heads | v heads] rows: this rank's of each
            qkv = w.linear([(fused, q, d), (fused, (hq + kv[0], hq + kv[1]), d),
                            (fused, (hq + hkv + kv[0], hq + hkv + kv[1]), d)])
            bias = prefix + "qkv_proj.bias"
            qkv_bias = (torch.cat([w.rows(bias, q, d), w.rows(bias, (hq + kv[0], hq + kv[1]), d),
                                   w.rows(bias, (hq + hkv + kv[0], hq + hkv + kv[1]), d)], 0)
                        if bias in w else None)
        else:
            qkv = w.linear([(prefix + "q_proj.weight", q, d), (prefix + "k_proj.weight", kv, d),
                            (prefix + "v_proj.weight", kv, d)])
            biases = [prefix + f"{x}_proj.bias" for x in "qkv"]
            qkv_bias = (torch.cat([w.rows(biases[0], q, d), w.rows(biases[1], kv, d), w.rows(biases[2], kv, d)], 0)
                        if all(b in w for b in biases) else None)
        nq, nkv = q[1] - q[0], kv[1] - kv[0]
        order = rotary_order(d, spec.rotary_dim)
        if order is not None:           # q and k rows of each head in the rotary's order; v as it is
            qkv = map_rows(qkv, lambda t: _reorder_heads(t, order, nq + nkv))
            qkv_bias = _reorder_heads(qkv_bias, order, nq + nkv) if qkv_bias is not None else None
            q_norm = RMSNorm(q_norm.weight[order.to(w.device)], q_norm.eps) if q_norm is not None else None
            k_norm = RMSNorm(k_norm.weight[order.to(w.device)], k_norm.eps) if k_norm is not None else None
        o_bias = prefix + "o_proj.bias"
        has_o_bias = o_bias in w and (shard is None or shard.rank == 0)
        att = cls(norm, qkv, qkv_bias, w.linear_columns(prefix + "o_proj.weight", q, d),
                  w.get(o_bias) if has_o_bias else None, cos_sin, nq, nkv, d, spec.softmax_scale, tp,
                  q_norm=q_norm, k_norm=k_norm, window=window, softcap=spec.attn_logit_softcap)
        if w.quant is not None and w.quant.fold_kv_scales:       # an e4m3 cache with the checkpoint's K/V scales
            att = fold_kv_scales(att, *read_kv_scales(w, prefix))
        return att

    def project(self, ops: OpSet, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                pre_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (residual None: the first layer's, which starts the residual stream) → the rotated
        q [T, Hq, D], residual + h (h normed by `pre_norm` first: the previous layer's post-norm); this step's
        K/V written into the cache at `slot_mapping`."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        extra = {"pre_norm": (pre_norm.weight, pre_norm.eps)} if pre_norm is not None else {}
        qkv, residual = ops.add_rms_norm_linear(h, residual, self.norm.weight, self.norm.eps, self.qkv,
                                                self.qkv_bias, **extra)         # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
        q, k = q.reshape(t, hq, d), k.reshape(t, hkv, d)
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None and self.q_norm.eps == self.k_norm.eps:
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)     # the rotary kernel's prologue
        else:
            if self.q_norm is not None:                                         # per head: rows of D
                q = ops.rms_norm(q.reshape(t * hq, d), self.q_norm.weight, self.q_norm.eps).view(t, hq, d)
            if self.k_norm is not None:
                k = ops.rms_norm(k.reshape(t * hkv, d), self.k_norm.weight, self.k_norm.eps).view(t, hkv, d)
        q = ops.rotary_write_kv(positions, q, k, v.view(t, hkv, d), self.cos_sin, k_cache, v_cache, slot_mapping,
                                qk_norm)
        return q, residual

    def attend(self, ops: OpSet, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D] → [T, Hq, D] (into `out` when given), causal over each sequence's cached K/V (its last
        `window` positions in a sliding layer)."""
        return ops.paged_attention(q, k_cache, v_cache, meta, self.scale, out=out, window=self.window,
                                   softcap=self.softcap)

    def output(self, ops: OpSet, attn: torch.Tensor) -> torch.Tensor:
        """attn [T, Hq D] → o_proj [T, H], summed over the ranks."""
        h = ops.linear(attn, self.o, self.o_bias)
        if self.tp is not None:
            self.tp.all_reduce(h)                                               # row-parallel o_proj
        return h


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor | None:
    """With partial rotary (rotary_dim < head_dim, transformers turning dims i and i + rotary_dim/2 of the first
    rotary_dim together and passing the rest), the order of a head's dims under which a whole-head rotate-half
    (dims j and j + head_dim/2) turns the same pairs: [rotated first halves | half the others | rotated second
    halves | the other half]. None when the whole head turns."""
    if rotary_dim in (0, head_dim):
        return None
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    idx = torch.arange(head_dim)
    return torch.cat([idx[:half], idx[rotary_dim:rotary_dim + rest], idx[half:rotary_dim],
                      idx[rotary_dim + rest:]])


def _reorder_heads(x: torch.Tensor, order: torch.Tensor, heads: int) -> torch.Tensor:
    """The first `heads` heads' rows of x [(heads + …) D, …] (the q and k rows of a QKV), each in `order`."""
    d = order.numel()
    qk = x[:heads * d].unflatten(0, (heads, d))[:, order.to(x.device)].flatten(0, 1)
    return torch.cat([qk, x[heads * d:]], 0)
