"""A checkpoint's calibrated K/V scales (compressed-tensors `kv_cache_scheme`: one K and one V scale a layer, at
`<layer>.self_attn.k_scale` / `v_scale`) applied to an FP8 KV cache by folding them into the layer's weights, so
that no kernel takes a scale of its own.

The cache is to hold e4m3(k / k_scale) and e4m3(v / v_scale), which attention dequantizes by k_scale and v_scale.
Dividing the k rows of the QKV projection (and their bias) by k_scale makes the projection produce k / k_scale;
where the layer norms each k head first (Qwen3, Gemma 3), the norm's weight takes the division instead, since
the norm would undo a scale before it. Rotary is linear, so the rotated key is scaled alike. The softmax scale
takes the factor k_scale back (q·k / k_scale · scale · k_scale), soft-cap included, since it sees the scaled
score. The v rows are divided by v_scale, and the attention output, a weighted mean of the values, comes out
divided by v_scale; o_proj takes it back, multiplied by v_scale (an FP8 o_proj: its row scales, and a static
activation scale divided alike, so that its activations quantize to the same bytes).

An FP8 projection changes only its fp32 scales; one held in the model dtype (a module the checkpoint left
unquantized) is multiplied in fp32 and rounded once.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from mii_async.errors import UnsupportedModelError
from mii_async.kernels.fp8_weight import FP8Weight

from .layers.norm import RMSNorm

if TYPE_CHECKING:
    from .layers.attention import Attention
    from .quantized_loading import LinearWeight
    from .weights import Weights


def read_kv_scales(w: Weights, prefix: str) -> tuple[float, float]:
    """The layer's (k_scale, v_scale) under `prefix` (`model.layers.N.self_attn.`), positive floats."""
    scales = []
    for name in (prefix + "k_scale", prefix + "v_scale"):
        if name not in w:
            raise UnsupportedModelError(f"the checkpoint's kv_cache_scheme promises K/V scales, but {name} is missing")
        t = w.source.get(name).float().reshape(-1)
        if t.numel() != 1 or not float(t[0]) > 0:
            raise UnsupportedModelError(f"{name}: a K/V scale per tensor is one positive number, got "
                                        f"{t.numel()} values {t[:4].tolist()}")
        scales.append(float(t[0]))
    return scales[0], scales[1]


def fold_kv_scales(att: Attention, k_scale: float, v_scale: float) -> Attention:
    """`att` with K/V produced divided by their scales and those scales taken back after attention."""
    hq, hkv, d = att.num_heads, att.num_kv_heads, att.head_dim
    k_rows, v_rows = slice(hq * d, (hq + hkv) * d), slice((hq + hkv) * d, (hq + 2 * hkv) * d)
    factors = torch.ones(att.qkv.shape[0], dtype=torch.float32)
    k_norm = att.k_norm
    if k_norm is not None:              # the norm removes a scale before it: its weight takes the division
        k_norm = RMSNorm((k_norm.weight.float() / k_scale).to(k_norm.weight.dtype), k_norm.eps)
    else:
        factors[k_rows] = 1 / k_scale
    factors[v_rows] = 1 / v_scale
    bias = att.qkv_bias
    if bias is not None:
        bias = (bias.float() * factors.to(bias.device)).to(bias.dtype)
    return dataclasses.replace(att, qkv=scale_rows(att.qkv, factors), qkv_bias=bias, k_norm=k_norm,
                               scale=att.scale * k_scale, o=scale_output(att.o, v_scale))


def scale_rows(weight: LinearWeight, factors: torch.Tensor) -> LinearWeight:
    """weight [N, K] with row i multiplied by factors[i] (fp32 [N])."""
    if isinstance(weight, FP8Weight):
        f = factors.to(weight.scale.device)
        scale = weight.scale * (f if not weight.blocked else f[:, None])
        return FP8Weight(weight.weight, scale, weight.input_scale)
    if isinstance(weight, torch.Tensor):
        return (weight.float() * factors.to(weight.device)[:, None]).to(weight.dtype)
    raise UnsupportedModelError(f"K/V scales fold into FP8 or float projections, not {type(weight).__name__}")


def scale_output(weight: LinearWeight, factor: float) -> LinearWeight:
    """weight · factor for an input that arrives divided by `factor` (o_proj after V scaled by 1 / factor)."""
    if isinstance(weight, FP8Weight):
        static = weight.input_scale / factor if weight.input_scale is not None else None
        return FP8Weight(weight.weight, weight.scale * factor, static)
    if isinstance(weight, torch.Tensor):
        return (weight.float() * factor).to(weight.dtype)
    raise UnsupportedModelError(f"K/V scales fold into FP8 or float projections, not {type(weight).__name__}")
