"""The op set the model calls: a torch reference (CPU and GPU) and CuPy/CUDA kernels.

`get_ops("reference")` returns the module of torch implementations, `get_ops("cuda")` the CuPy kernels
(csrc/*.cu); every backend has the same signatures. `resolve_backend("auto", device)` is "cuda" on a CUDA
device when CuPy imports, else "reference". Nothing here knows about the engine above it.
"""
from __future__ import annotations

from types import ModuleType

BACKENDS = ("reference", "cuda")


def cupy_available() -> bool:
    import importlib

    try:
        importlib.import_module("cupy")
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device_type: str) -> str:
    if backend == "auto":
        return "cuda" if device_type == "cuda" and cupy_available() else "reference"
    if backend == "cuda" and device_type != "cuda":
        raise ValueError("the cuda kernels need a CUDA device")
    return backend


def get_ops(backend: str = "reference") -> ModuleType:
    if backend == "reference":
        from . import reference

        return reference
    if backend == "cuda":
        from . import cuda

        return cuda
    raise ValueError(f"unknown kernel backend {backend!r}; available: {', '.join(BACKENDS)}")
