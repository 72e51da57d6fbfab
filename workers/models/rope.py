"""Rotary embedding tables: inverse frequencies for HF's rope types, and the [max_pos, D] cos|sin cache."""
from __future__ import annotations

import math
from typing import Any

import torch

from mii_async.errors import UnsupportedModelError

ROPE_TYPES = ("default", "linear", "llama3")


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim / 2] fp32, as transformers computes them for the same config."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedModelError(f"rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, D] fp32 holding [cos | sin] of position * inv_freq."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]                 # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], -1).to(device)
