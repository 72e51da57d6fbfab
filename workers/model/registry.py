"""The model registry: config.json's `architectures` → the class that loads and runs that architecture.

Each architecture file names, on its class, the architectures it runs (`architectures`) and the model_types
that stand for them (`model_types`), for configs without an `architectures` list, as GGUF-converted and
hand-written ones may be. A new architecture is one file over the shared blocks (layers/) and its class
added to MODELS here.
"""
from __future__ import annotations

from typing import Any

from mii_async.errors import UnsupportedModelError

from .decoder import DecoderModel
from .gemma import Gemma2Model, Gemma3Model
from .llama import LlamaModel
from .mixtral import MixtralModel
from .phi3 import Phi3Model
from .qwen3 import Qwen3Model
from .qwen3_moe import Qwen3MoeModel
from .spec import ModelSpec

MODELS: tuple[type[DecoderModel], ...] = (
    LlamaModel, MixtralModel, Qwen3Model, Qwen3MoeModel, Gemma2Model, Gemma3Model, Phi3Model)

ARCHITECTURES: dict[str, type[DecoderModel]] = {a: cls for cls in MODELS for a in cls.architectures}
MODEL_TYPES: dict[str, str] = {t: a for cls in MODELS for t, a in cls.model_types.items()}
assert len(ARCHITECTURES) == sum(len(cls.architectures) for cls in MODELS), "an architecture named twice"
assert set(MODEL_TYPES.values()) <= set(ARCHITECTURES), "a model_type standing for no architecture"


def architecture_of(cfg: dict[str, Any]) -> str:
    """The architecture a config.json asks for: its `architectures[0]`, or without that list the one its
    `model_type` stands for; its class has checked the config's fields. Raises UnsupportedModelError naming the
    architecture (or the model_type) and listing the supported ones."""
    names = cfg.get("architectures") or []
    names = [names] if isinstance(names, str) else names
    if names:
        arch = names[0]
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(f"architecture {arch!r} (config.json architectures) is not supported; "
                                        f"supported: {_supported()}")
    else:
        mtype = cfg.get("model_type")
        if mtype not in MODEL_TYPES:
            raise UnsupportedModelError(f"model_type {mtype!r} is not supported (config.json names no "
                                        f"architectures); supported: {_supported()}")
        arch = MODEL_TYPES[mtype]
    ARCHITECTURES[arch].check_config(cfg)
    return arch


def model_class(spec: ModelSpec) -> type[DecoderModel]:
    """The class whose `load(spec, reader, dtype, device, max_positions, ops, tp)` builds this model."""
    if spec.architecture not in ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {spec.architecture!r} is not supported; supported: {_supported()}")
    return ARCHITECTURES[spec.architecture]


def _supported() -> str:
    return f"{', '.join(ARCHITECTURES)} (model_type {', '.join(MODEL_TYPES)})"
