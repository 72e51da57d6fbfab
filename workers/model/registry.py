"""The model registry: config.json's `architectures` → the class that loads and runs that architecture."""
from __future__ import annotations

from .llama import LlamaModel
from .loader import ModelSpec


def model_class(spec: ModelSpec) -> type[LlamaModel]:
    """The class whose `load(spec, reader, dtype, device, max_positions, ops, tp)` builds this model."""
    return LlamaModel
