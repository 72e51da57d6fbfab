"""The op set the model calls: a torch reference (CPU and GPU) and, later, CuPy/CUDA kernels.

`get_ops("reference")` returns the module of torch implementations; every backend has the same signatures.
Nothing here knows about the engine above it.
"""
from __future__ import annotations

from types import ModuleType

BACKENDS = ("reference",)


def get_ops(backend: str = "reference") -> ModuleType:
    if backend == "reference":
        from . import reference

        return reference
    raise ValueError(f"unknown kernel backend {backend!r}; available: {', '.join(BACKENDS)}")
