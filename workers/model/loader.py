"""Read an HF model directory: the model spec from config.json and weights from *.safetensors.

Weights are memory-mapped with safetensors and read tensor by tensor (sharded checkpoints through
model.safetensors.index.json), with a progress bar. No pickle: *.bin checkpoints are refused.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch

from mii_async.errors import ModelNotFoundError, UnsupportedModelError

from .moe_spec import moe_spec
from .quantization import WeightQuant, checkpoint_quantization, weight_quantization
from .registry import ARCHITECTURES, MODEL_TYPES, architecture_of
from .rope import local_rope_theta, position_limit, rope_config, rotary_dim
from .spec import ModelSpec


def _ids(v: Any) -> set[int]:
    if v is None:
        return set()
    return {int(x) for x in v} if isinstance(v, (list, tuple)) else {int(v)}


def load_spec(path: Path) -> ModelSpec:
    """config.json (and generation_config.json's EOS ids) → the spec. An architecture that no model file runs,
    a config field that its layers do not compute, or a quantization_config whose weights it cannot read, is
    refused here, naming it, before any weight is read."""
    cfg = json.loads((path / "config.json").read_text())
    arch = architecture_of(cfg)
    checkpoint_quantization(cfg)           # refuses a quantized format the loader would read without its scales
    cfg = {**ARCHITECTURES[arch].config_defaults, **cfg}   # what its config class fills in when absent
    mtype = cfg.get("model_type") or next((t for t, a in MODEL_TYPES.items() if a == arch), "")
    theta, scaling = rope_config(cfg)      # refuses a rope the layers do not compute, naming its field
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    window, layer_types = _sliding_layers(cfg, mtype)
    scalar = cfg.get("query_pre_attn_scalar")
    return ModelSpec(
        architecture=arch,
        model_type=mtype,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=position_limit(int(cfg.get("max_position_embeddings", 4096)), scaling),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", mtype == "qwen2")),
        eos_token_ids=frozenset(_ids(cfg.get("eos_token_id")) | _ids(gen.get("eos_token_id"))),
        bos_token_id=cfg.get("bos_token_id"),
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        rotary_dim=rotary_dim(cfg, head_dim),
        local_rope_theta=local_rope_theta(cfg),
        attention_scale=float(scalar) ** -0.5 if scalar else None,
        attn_logit_softcap=_positive(cfg, "attn_logit_softcapping"),
        final_logit_softcap=_positive(cfg, "final_logit_softcapping"),
        moe=moe_spec(cfg),
    )


def load_quantization(path: Path, requested: str | None) -> WeightQuant | None:
    """How the linear weights load: the checkpoint's FP8 scheme (config.json's quantization_config), else the
    `quantization` option's (workers/model/quantization.py), else None (the model dtype)."""
    return weight_quantization(json.loads((path / "config.json").read_text()), requested)


QWEN_WINDOWS = ("qwen2", "qwen3", "qwen2_moe")   # use_sliding_window, then max_window_layers
GEMMA_PATTERNS = {"gemma2": 2, "gemma3_text": 6}   # every n-th layer global, as their config classes lay out


def _sliding_layers(cfg: dict[str, Any], mtype: str) -> tuple[int | None, tuple[str, ...]]:
    """(the window of the sliding layers or None, each layer's type or () for all alike), as transformers
    decides (a layer's type also picks its rope in Gemma 3, window or not). Qwen: use_sliding_window on, and
    `layer_types`, or without them the layers from max_window_layers on. Gemma: `layer_types`, or every n-th
    layer global (sliding_window_pattern). Others (Mistral, Phi-3, Mixtral): every layer, where sliding_window
    is set. A window no layer uses is None."""
    window = cfg.get("sliding_window") or None
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if mtype == "qwen3_moe":                 # its config has no max_window_layers: every layer slides when on
        return (window if cfg.get("use_sliding_window", False) else None), ()
    if mtype in QWEN_WINDOWS:
        window = window if cfg.get("use_sliding_window", False) else None
        types = types or ["sliding_attention" if i >= int(cfg.get("max_window_layers", 28)) else "full_attention"
                          for i in range(n)]
    elif mtype in GEMMA_PATTERNS:
        every = int(cfg.get("sliding_window_pattern") or GEMMA_PATTERNS[mtype])
        types = types or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    else:
        return window, ()
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types must name sliding_attention or full_attention for each of the "
                                    f"{n} layers, got {types!r}")
    return (window if "sliding_attention" in types else None), tuple(types)


def _positive(cfg: dict[str, Any], field: str) -> float | None:
    """A soft-cap: None when absent or null. Raises UnsupportedModelError naming the field for a value ≤ 0."""
    value = cfg.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UnsupportedModelError(f"{field} must be a positive number or null, got {value!r}")
    return float(value)


class WeightReader:
    """Name → tensor over one or many safetensors files, memory-mapped."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise ModelNotFoundError(f"{path} holds no *.safetensors weights (pickled *.bin files are not loaded)")
            weight_map = {}
        self._handles = {f: safe_open(str(path / f), framework="pt") for f in files}
        if not weight_map:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self._map = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def get(self, name: str) -> torch.Tensor:
        if name not in self._map:
            raise ModelNotFoundError(f"weight {name!r} is missing from the checkpoint")
        return self._handles[self._map[name]].get_tensor(name)

    def get_slice(self, name: str, dim: int, start: int, end: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, end) of a weight, read alone from the memory-mapped file:
        a tensor-parallel rank never materialises the whole tensor."""
        if name not in self._map:
            raise ModelNotFoundError(f"weight {name!r} is missing from the checkpoint")
        sl = self._handles[self._map[name]].get_slice(name)
        return sl[start:end] if dim == 0 else sl[:, start:end]

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from the file's header (nothing read)."""
        if name not in self._map:
            raise ModelNotFoundError(f"weight {name!r} is missing from the checkpoint")
        return tuple(self._handles[self._map[name]].get_slice(name).get_shape())

    def names(self) -> Iterator[str]:
        return iter(self._map)


class TensorReader:
    """The WeightReader interface over tensors already in memory (name → tensor), e.g. a transformers model's
    state_dict: benchmarks and parity checks build a model on the GPU and serve its very weights, no files."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._t = tensors

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def get(self, name: str) -> torch.Tensor:
        if name not in self._t:
            raise ModelNotFoundError(f"weight {name!r} is missing")
        return self._t[name]

    def get_slice(self, name: str, dim: int, start: int, end: int) -> torch.Tensor:
        t = self.get(name)
        return t[start:end] if dim == 0 else t[:, start:end]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def names(self) -> Iterator[str]:
        return iter(self._t)
