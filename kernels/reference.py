"""Torch reference of every op: the specification the CUDA kernels follow. Runs on CPU and GPU.

Shapes: T tokens in the step, Hq query heads, Hkv KV heads, D head dim, H hidden size, F ffn size,
N KV blocks of `block_size` tokens, E experts of which each token takes k. Caches are [N, block_size, Hkv, D].
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import capped_prefill, cpu_decode_attention, kv_store
from .fp8_weight import FP8Weight
from .int_weight import Int4Weight, Int8Weight
from .metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back: x [T, H], weight [H] → [T, H]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'). All [T, H]."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2F] holding [gate | up] → silu(gate) * up [T, F]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2F] holding [gate | up] → gelu_tanh(gate) * up [T, F] (GeGLU: Gemma's gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def linear(x: torch.Tensor, weight: torch.Tensor | FP8Weight | Int4Weight | Int8Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] · weight [N, K]ᵀ (+ bias [N]) → [T, N]. An FP8 weight (fp8_weight.py) is dequantized to x's
    dtype first: every op that projects through `linear` takes one, and computes as the model would whose weights
    are the dequantized ones (activations are not quantized here). A CPU integer weight (int_weight.py) runs
    through torch's weight-only GEMM for its layout."""
    if isinstance(weight, (Int4Weight, Int8Weight)):
        y = weight.linear(x)
        return y + bias if bias is not None else y
    if isinstance(weight, FP8Weight):
        weight = weight.dequantize(x.dtype)
    return F.linear(x, weight, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor | FP8Weight, bias: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None, *,
                        pre_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The projection after a norm: linear(fused_add_rms_norm(x, residual)) → (y [T, N], residual' [T, H]);
    with residual None, linear(rms_norm(x)) and x is residual'. `out_dtype`: y cast to it. `pre_norm` (weight,
    eps): x is first rms_norm(x, weight, eps) (the previous block's post-norm, Gemma's)."""
    if pre_norm is not None:
        x = rms_norm(x, pre_norm[0], pre_norm[1])
    if residual is None:
        normed, residual = rms_norm(x, norm_weight, eps), x
    else:
        normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    y = linear(normed, weight, bias)
    return (y if out_dtype is None else y.to(out_dtype)), residual


def add_rms_norm_gate_up(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         gate_up: torch.Tensor | FP8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLP's input: silu_and_mul(add_rms_norm_linear(x, residual, …, gate_up)), gate_up [2F, H] →
    (silu(gate) * up [T, F], residual' [T, H])."""
    y, residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up)
    return silu_and_mul(y), residual


def add_rms_norm_mlp(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     gate_up: torch.Tensor | FP8Weight,
                     down: torch.Tensor | FP8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """A SwiGLU MLP over the normed residual stream: (linear(add_rms_norm_gate_up(x, …)[0], down) [T, H],
    residual' [T, H]). One op, so that an op set may fuse across its middle (the CUDA one quantizes
    silu(gate) * up for FP8 weights without writing it)."""
    y, residual = add_rms_norm_gate_up(x, residual, norm_weight, eps, gate_up)
    return linear(y, down), residual


def add_rms_norm_gate_up_gelu(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                              eps: float, gate_up: torch.Tensor | FP8Weight, *,
                              pre_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_gate_up with GeGLU: (gelu_tanh(gate) * up [T, F], residual' [T, H]); `pre_norm` as
    add_rms_norm_linear takes it."""
    y, residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up, pre_norm=pre_norm)
    return gelu_tanh_and_mul(y), residual


def moe_route(x: torch.Tensor, router: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing: x [T, H] (normed), router [E, H] → (weights [T, k] fp32, expert ids [T, k] int64).
    The softmax is over all E router logits in fp32; with `renormalize` the k chosen weights are divided by
    their sum (Mixtral; Qwen3-MoE's norm_topk_prob)."""
    probs = torch.softmax(linear(x, router).float(), dim=-1)                  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """The chosen experts' SwiGLUs, summed with their routing weights: x [T, H], weights [T, k] fp32, ids [T, k],
    gate_up [E, 2F, H] ([gate | up] rows of each expert), down [E, H, F] → [T, H].

    As transformers computes it: one expert at a time over the tokens that chose it, each token's output scaled
    by its weight in fp32 and added back in x's dtype, experts in ascending order. Reads the chosen ids on the
    host (not capturable in a CUDA graph)."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        y = linear(silu_and_mul(linear(x[tok], gate_up[e])), down[e])          # [n, H]
        out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
    return out


def add_rms_norm_moe(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse layer after its (residual add and) RMSNorm: (the experts' output [T, H], residual' [T, H]). The
    norm as fused_add_rms_norm (rms_norm without a residual), then moe_route and moe_experts."""
    if residual is None:
        normed, residual = rms_norm(x, norm_weight, eps), x
    else:
        normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    weights, ids = moe_route(normed, router, top_k, renormalize)
    return moe_experts(normed, weights, ids, gate_up, down), residual


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (GPT-NeoX / HF Llama) rotary embedding.

    positions [T] int64; q [T, Hq, D]; k [T, Hkv, D]; cos_sin [max_pos, D] fp32 holding [cos | sin] of the
    D/2 frequencies. Returns rotated (q, k) in their dtype.
    """
    half = q.shape[-1] // 2
    cs = cos_sin[positions]                                  # [T, D]
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1).unsqueeze(1).to(q.dtype)   # [T, 1, D]
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1).unsqueeze(1).to(q.dtype)

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    return rot(q), rot(k)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes k, v [T, Hkv, D] into the caches at flat slots [T] (in place)."""
    kv_store.store(k_cache, slot_mapping, k)
    kv_store.store(v_cache, slot_mapping, v)


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """Rotary on q and k, then k and v written into the caches (one fused kernel on CUDA). q [T, Hq, D],
    k, v [T, Hkv, D] (rows may be strided views of one QKV projection). `qk_norm` (q's weight [D], k's weight
    [D], eps): an RMSNorm of each q and k head first (Qwen3, Gemma 3). Returns the rotated q [T, Hq, D]."""
    if qk_norm is not None:
        q, k = head_norms(q, k, qk_norm, rms_norm)
    q, k = rotary_embedding(positions, q, k, cos_sin)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def head_norms(q: torch.Tensor, k: torch.Tensor, qk_norm: tuple[torch.Tensor, torch.Tensor, float],
               norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm` (an op set's rms_norm) over each head of q [T, Hq, D] and k [T, Hkv, D], as rows of D."""
    (t, hq, d), hkv = q.shape, k.shape[1]
    return (norm(q.reshape(t * hq, d), qk_norm[0], qk_norm[2]).view(t, hq, d),
            norm(k.reshape(t * hkv, d), qk_norm[1], qk_norm[2]).view(t, hkv, d))


def _blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, Hkv, D] at block ids tables [...] → [..., bs, Hkv, D]. index_select copies whole blocks
    (on the CPU 1.2× faster than advanced indexing in fp32, 3.5× in bf16). The cache is contiguous, as
    kv_cache.allocate makes it."""
    return kv_store.select_blocks(cache, tables.reshape(-1)).view(*tables.shape, *cache.shape[1:])


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: blocks [nb] → [length, Hkv, D]."""
    return _blocks(cache, blocks).flatten(0, 1)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its blocked KV history (this step's K/V
    already written). q [T, Hq, D] → [T, Hq, D]. GQA: Hq is a multiple of Hkv.

    A sequence with query length L and context length C holds its queries at positions C-L … C-1; query i
    attends keys 0 … C-L+i, or with a sliding `window` W only the last W of them (keys C-L+i-W+1 … C-L+i, as
    transformers' sliding mask). `softcap`: scores s·scale become softcap·tanh(s·scale / softcap) before the
    softmax (Gemma 2). Decodes (L = 1): on the CPU each row attends its keys in place (cpu_decode_attention.py,
    its plan built once per step and window); elsewhere they are batched over a padded gather. Prefill chunks
    loop. `out`: where to write the result (shaped as q), e.g. a piecewise graph's static input.
    """
    assert window is None or window > 0, f"a sliding window holds at least one position, got {window}"
    out = torch.empty_like(q) if out is None else out
    nd = meta.num_decodes
    if nd and q.device.type == "cpu":
        plan = _decode_plan(meta, k_cache.shape[1], window)
        cpu_decode_attention.decode_attention(q, k_cache, v_cache, plan, scale, out, softcap)
    elif nd:
        _padded_decode_attention(q, k_cache, v_cache, meta, scale, out, window, softcap)
    prefill_attention(q, k_cache, v_cache, meta, scale, out, window, softcap)
    return out


def _decode_plan(meta: AttentionMetadata, block_size: int,
                 window: int | None) -> cpu_decode_attention.DecodePlan:
    """The step's CPU decode plan for `window`, made by the first layer that asks and kept in meta.memo."""
    key = ("cpu_decode_plan", block_size, window)
    plan = meta.memo.get(key)
    if plan is None:
        plan = cpu_decode_attention.plan_decodes(meta.block_tables, meta.context_lens_host[:meta.num_decodes],
                                                 block_size, window)
        meta.memo[key] = plan
    return plan  # type: ignore[return-value]


def _padded_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata, scale: float, out: torch.Tensor, window: int | None,
                             softcap: float | None) -> None:
    """paged_attention's decode rows [0, num_decodes) written into `out`, all of them in one masked attention
    over their blocks gathered and padded to the longest context: a few large launches, which is what a GPU
    wants (the CPU reads in place instead, cpu_decode_attention.py)."""
    nd = meta.num_decodes
    bs = k_cache.shape[1]
    nb = -(-max(meta.context_lens_host[:nd]) // bs)
    tables = meta.block_tables[:nd, :nb]
    keys = _blocks(k_cache, tables).flatten(1, 2).transpose(1, 2)   # [nd, Hkv, nb*bs, D]
    vals = _blocks(v_cache, tables).flatten(1, 2).transpose(1, 2)
    pos = torch.arange(nb * bs, device=q.device)[None, :]
    clens = meta.context_lens[:nd, None]
    mask = pos < clens
    if window is not None:
        mask &= pos >= clens - window
    o = _attend(q[:nd].unsqueeze(2), keys.to(q.dtype), vals.to(q.dtype), mask[:, None, None, :], scale,
                softcap)
    out[:nd] = o.squeeze(2)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor, window: int | None = None,
                      softcap: float | None = None) -> None:
    """The prompt-chunk part of paged_attention: rows from num_decodes on, written into `out` [T, Hq, D].
    Soft-capped chunks are batched where that pays (capped_prefill.py), else each sequence is attended alone."""
    if softcap is not None and capped_prefill.worth_batching(meta):
        capped_prefill.capped_prefill(q, k_cache, v_cache, meta, scale, out, window, softcap, _attend)
        return
    bs = k_cache.shape[1]
    start = meta.num_decodes
    for s in range(meta.num_decodes, len(meta.query_lens)):
        qlen, clen = meta.query_lens[s], meta.context_lens_host[s]
        nb = -(-clen // bs)
        # Keys before the first query's window are never attended: they are left out of the gather.
        lo = max(0, clen - qlen - window + 1) if window is not None else 0
        keys = _gather(k_cache, meta.block_tables[s, :nb], clen)[lo:].transpose(0, 1).to(q.dtype)  # [Hkv, C', D]
        vals = _gather(v_cache, meta.block_tables[s, :nb], clen)[lo:].transpose(0, 1).to(q.dtype)
        qs = q[start:start + qlen].transpose(0, 1)                         # [Hq, L, D]
        if qlen == clen and window is None and softcap is None:
            o = F.scaled_dot_product_attention(qs, keys, vals, is_causal=True, scale=scale, enable_gqa=True)
        else:
            qpos = torch.arange(clen - qlen, clen, device=q.device)[:, None]
            kpos = torch.arange(lo, clen, device=q.device)[None, :]
            mask = kpos <= qpos                                            # [L, C']
            if window is not None:
                mask &= kpos > qpos - window
            o = _attend(qs, keys, vals, mask, scale, softcap)
        out[start:start + qlen] = o.transpose(0, 1)
        start += qlen


_CAPPED_SCORES = 1 << 26        # fp32 scores a soft-capped attention holds at once (256 MiB): queries in chunks


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """Masked attention: q [..., Hq, L, D], k, v [..., Hkv, C, D], mask [..., L, C] (True: attended; every
    query attends at least one key) → [..., Hq, L, D]. Without `softcap`, SDPA; with it, transformers' eager
    order in fp32 (scores · scale, soft-cap, mask, softmax, · V), over chunks of queries."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    g = q.shape[-3] // k.shape[-3]
    kf = k.float().repeat_interleave(g, dim=-3).transpose(-1, -2)          # [..., Hq, D, C]
    vf = v.float().repeat_interleave(g, dim=-3)
    out = torch.empty_like(q)
    step = max(1, _CAPPED_SCORES // max(1, q[..., :1, :].numel() // q.shape[-1] * k.shape[-2]))
    for a in range(0, q.shape[-2], step):
        s = torch.matmul(q[..., a:a + step, :].float(), kf) * scale         # [..., Hq, l, C]
        s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask[..., a:a + step, :], float("-inf"))
        out[..., a:a + step, :] = torch.matmul(s.softmax(-1), vf).to(q.dtype)
    return out
