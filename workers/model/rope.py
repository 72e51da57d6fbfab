"""Rotary embedding: a config's rope fields read as transformers reads them, inverse frequencies and the cos/sin
scale for HF's rope types, and the [max_pos, D] cos|sin cache.

`rope_config` runs when config.json is read (workers/model/loader.py), so that a rope the model does not implement
is refused, naming its field, before any weight is loaded. The types that depend on the sequence's length
(dynamic NTK, longrope) are not implemented: their frequencies change as a sequence grows, so the K/V already
cached would hold positions rotated by other frequencies.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from mii_async.errors import UnsupportedModelError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_REQUIRED = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "yarn": ()}
_ORIGINAL = "original_max_position_embeddings"


def rope_config(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the rope type's parameters or None) from config.json: transformers v5's `rope_parameters`,
    or v4's `rope_scaling` beside a top-level `rope_theta`. The parameters get transformers' defaults: llama3 and
    yarn's original_max_position_embeddings is the model's top-level one, else its max_position_embeddings;
    yarn's factor, when null, is their ratio. Raises UnsupportedModelError naming the field otherwise."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(field) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedModelError(f"{field} must be one dict of rope parameters (per-layer rope is not "
                                    f"supported), got {rope!r}")
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    kind = _kind(scaling)
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"{field}.rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    for key in _REQUIRED[kind]:
        if scaling.get(key) is None:
            raise UnsupportedModelError(f"{field}.{key} is missing: rope type {kind!r} needs it")
    if (partial := scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"{field}.partial_rotary_factor {partial!r} is not supported: the whole head "
                                    "is rotated")
    if kind in ("llama3", "yarn"):
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        original = cfg.get(_ORIGINAL) or scaling.get(_ORIGINAL) or max_pos   # transformers: the top-level first
        scaling[_ORIGINAL] = original
        if kind == "yarn" and scaling.get("factor") is None:
            scaling["factor"] = max_pos / original
    return theta, (scaling or None)


def position_limit(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The positions a model takes: YaRN stretches its original context by its factor (Qwen2.5's recipe keeps
    max_position_embeddings at the original 32k beside a yarn factor of 4: 128k, as vLLM derives it)."""
    if _kind(scaling) != "yarn":
        return max_position_embeddings
    assert scaling is not None
    return max(max_position_embeddings, int(float(scaling[_ORIGINAL]) * float(scaling["factor"])))


def _kind(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim / 2] fp32, as transformers computes them for the same config (`scaling` as `rope_config` gives
    it)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = _kind(scaling)
    if kind == "default":
        return inv
    assert scaling is not None
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling[_ORIGINAL])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_frequencies(head_dim, theta, scaling)
    raise UnsupportedModelError(f"rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def _yarn_inv_frequencies(dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: extrapolated (original) frequencies for the dims that rotate fast, interpolated (÷ factor) for the
    slow ones, a linear ramp between; transformers' `_compute_yarn_parameters`, op for op."""
    factor = float(scaling["factor"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling[_ORIGINAL]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                                        # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The scale transformers applies to cos and sin (so to q·k twice): YaRN's mscale, 1 for the other types."""
    if _kind(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if (given := scaling.get("attention_factor")) is not None:
        return float(given)
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, device: torch.device,
                  scale: float = 1.0) -> torch.Tensor:
    """[max_positions, D] fp32 holding [cos | sin] of position * inv_freq, each times `scale` (the rope type's
    attention factor)."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]                 # [P, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat([cos, sin], -1).to(device)
