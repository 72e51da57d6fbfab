"""Rotary embedding: a config's rope fields read as transformers reads them, inverse frequencies and the cos/sin
scale for HF's rope types, and the [max_pos, D] cos|sin cache.

`rope_config` runs when config.json is read (workers/model/loader.py), so that a rope the model does not implement
is refused, naming its field, before any weight is loaded. Dynamic NTK is not implemented: its frequencies change
as a sequence grows, so the K/V already cached would hold positions rotated by other frequencies.

LongRoPE (Phi-3, "longrope" or its old name "su") has a short and a long set of frequencies. transformers rotates a
sequence with the long set once it is longer than original_max_position_embeddings, and its generate() then
computes the whole sequence again (Phi3ForCausalLM.prepare_inputs_for_generation), so that no key rotated one
way meets a query rotated the other: q·k depends on the positions' difference only within one set. A paged
cache keeps each token's K once, so here the set is the engine's, chosen by its context (max_model_len): the
long one where it exceeds original_max_position_embeddings, else the short one. That is transformers' own set
for every sequence on that side of the original context; a server that must match it on short prompts sets
max_model_len to the original context.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from mii_async.errors import UnsupportedModelError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_REQUIRED = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "yarn": (), "longrope": ("short_factor", "long_factor")}
LAYER_TYPES = ("full_attention", "sliding_attention")   # the keys of a rope nested by layer type (Gemma 3)
PHI3_ORIGINAL = 4096            # Phi3Config's original_max_position_embeddings, which transformers puts first
_ORIGINAL = "original_max_position_embeddings"


def rope_config(cfg: dict[str, Any], layer_type: str = "full_attention") -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the rope type's parameters or None) from config.json: transformers v5's `rope_parameters`
    (nested by layer type in Gemma 3: `layer_type`'s), or v4's `rope_scaling` beside a top-level `rope_theta`.
    The parameters get transformers' defaults: llama3, yarn and longrope's original_max_position_embeddings is the
    model's top-level one, else its max_position_embeddings (Phi-3: 4096); yarn's and longrope's factor, when
    null, is their ratio. Raises UnsupportedModelError naming the field otherwise."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(field) or {}
    if isinstance(rope, dict) and rope and set(rope) <= set(LAYER_TYPES):
        field, rope = f"{field}.{layer_type}", rope.get(layer_type) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedModelError(f"{field} must be one dict of rope parameters, or one per layer type "
                                    f"({', '.join(LAYER_TYPES)}), got {rope!r}")
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = _kind(scaling)
    phi3 = cfg.get("model_type") == "phi3" or "Phi3ForCausalLM" in (cfg.get("architectures") or [])
    if kind == "su" or (kind == "yarn" and phi3):   # Phi3Config reads both as longrope
        kind = scaling["rope_type"] = "longrope"
        scaling.pop("type", None)
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"{field}.rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    for key in _REQUIRED[kind]:
        if scaling.get(key) is None:
            raise UnsupportedModelError(f"{field}.{key} is missing: rope type {kind!r} needs it")
    if kind in ("llama3", "yarn", "longrope"):
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        if phi3:
            original = cfg.get(_ORIGINAL) or PHI3_ORIGINAL
        else:                                                # transformers: the top-level first
            original = cfg.get(_ORIGINAL) or scaling.get(_ORIGINAL) or max_pos
        scaling[_ORIGINAL] = original
        if kind in ("yarn", "longrope") and scaling.get("factor") is None:
            scaling["factor"] = max_pos / original
    return theta, (scaling or None)


def rotary_dim(cfg: dict[str, Any], head_dim: int) -> int:
    """The leading dims of a head that rotary turns: head_dim × partial_rotary_factor (top-level, or in the rope
    parameters). Raises UnsupportedModelError naming the factor where it leaves an odd count of dims unturned or
    does not match a longrope's factor lists."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope and set(rope) <= set(LAYER_TYPES):
        rope = rope.get("full_attention") or {}
    given = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None   # transformers: this first
    factor = float(given if given is not None else cfg.get("partial_rotary_factor") or 1.0)
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2 or (head_dim - dim) % 2:
        raise UnsupportedModelError(f"partial_rotary_factor {factor} turns {dim} of the head's {head_dim} dims: "
                                    "an even count of dims, leaving an even count unturned, is supported")
    _, scaling = rope_config(cfg)
    if _kind(scaling) == "longrope":
        assert scaling is not None
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != dim // 2:
                raise UnsupportedModelError(f"rope_scaling.{key} has {len(scaling[key])} factors; the {dim} rotated "
                                            f"dims take {dim // 2}")
    return dim


def local_rope_theta(cfg: dict[str, Any]) -> float | None:
    """The sliding layers' own rope base, where they have one (Gemma 3: `rope_local_base_freq`, or v5's
    rope_parameters.sliding_attention), default rope; None where they share the model's rope. Raises
    UnsupportedModelError naming the field for another rope type there."""
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope and set(rope) <= set(LAYER_TYPES):
        theta, scaling = rope_config(cfg, "sliding_attention")
        if scaling is not None and _kind(scaling) != "default":
            raise UnsupportedModelError(f"rope_parameters.sliding_attention.rope_type {_kind(scaling)!r} is not "
                                        "supported: the sliding layers take the default rope")
        return theta
    base = cfg.get("rope_local_base_freq")
    return float(base) if base is not None else None


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
    if kind == "longrope":                                   # the short set; `rotary_cache` may take the long
        return _longrope_inv_frequencies(head_dim, theta, scaling["short_factor"])
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


def _longrope_inv_frequencies(dim: int, base: float, factors: list[float]) -> torch.Tensor:
    """One of LongRoPE's sets: the default frequencies each divided by its factor, as transformers computes it."""
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** shape)


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The scale transformers applies to cos and sin (so to q·k twice): YaRN's mscale, LongRoPE's
    sqrt(1 + ln factor / ln original), 1 for the other types."""
    kind = _kind(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    assert scaling is not None
    if (given := scaling.get("attention_factor")) is not None:
        return float(given)
    factor = float(scaling["factor"])
    if kind == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(scaling[_ORIGINAL])) if factor > 1 else 1.0

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


def rotary_cache(head_dim: int, rotary_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int,
                 device: torch.device) -> torch.Tensor:
    """The [max_positions, head_dim] fp32 cos|sin cache of a rope: its frequencies over the first `rotary_dim`
    dims (0: all), cos and sin scaled by its attention factor; LongRoPE's long set where max_positions (the
    engine's context) exceeds original_max_position_embeddings, its short set otherwise (the module's docstring
    says why). Past `rotary_dim` the frequencies are zero and unscaled (cos 1, sin 0): those dims pass unturned,
    in the order attention.rotary_order gives the head."""
    rd = rotary_dim or head_dim
    inv = inv_frequencies(rd, theta, scaling)
    if scaling is not None and _kind(scaling) == "longrope" and max_positions > int(scaling[_ORIGINAL]):
        inv = _longrope_inv_frequencies(rd, theta, scaling["long_factor"])
    table = cos_sin_cache(inv, max_positions, device, attention_factor(scaling))
    if rd == head_dim:
        return table
    pad = (head_dim - rd) // 2
    cos, sin = table.split(rd // 2, -1)
    ones, zeros = cos.new_ones(max_positions, pad), cos.new_zeros(max_positions, pad)
    return torch.cat([cos, ones, sin, zeros], -1)
