"""The op set the model calls: a torch reference (CPU and GPU) and CuPy/CUDA kernels.

This directory installs as `mii_async.kernels`. From a checkout's root, which is on sys.path under
`python -m` and in the tests, it is also importable as a top-level `kernels`, the name of the Hub's
`kernels` distribution, which transformers imports when it is installed (transformers ≥ 5.25 depends on
it). Imported under that name, this file puts the distribution in its place (`_yield_top_level_name`); where
none is installed, the name stays this directory's, which has no `__version__`, so transformers' check finds
no usable `kernels` (as it did before 5.25).

`get_ops("reference")` returns the op set of torch implementations, `get_ops("cuda", config)` the CuPy
kernels (csrc/*.cu) bound to a KernelConfig (config.py; op_set.py), `get_ops("cpu")` the CPU's native kernels
(csrc/cpu/, built for the host at first use: cpu_build.py); every backend has the same signatures.
`resolve_backend("auto", device)` is "cuda" on a CUDA device when CuPy imports, "cpu" on the CPU when the
native kernels build, else "reference". Nothing here
knows about the engine above it, and nothing is read from the environment at import.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:       # imported in get_ops: under the top-level name this package may yield (above)
    from .config import KernelConfig
    from .op_set import OpSet


def _yield_top_level_name() -> None:
    """Loads the `kernels` package found on sys.path past this checkout and makes it sys.modules["kernels"]
    (import returns what sys.modules holds once the file has run); if there is none, this module keeps it."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == root:
            continue
        spec = importlib.machinery.PathFinder.find_spec("kernels", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["kernels"] = module
            spec.loader.exec_module(module)
            return


if __name__ == "kernels":
    _yield_top_level_name()

BACKENDS = ("reference", "cuda", "cpu")


def cupy_available() -> bool:
    import importlib

    try:
        importlib.import_module("cupy")
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device_type: str) -> str:
    if backend == "auto":
        if device_type == "cuda":
            return "cuda" if cupy_available() else "reference"
        return "cpu" if device_type == "cpu" and cpu_kernels_available() else "reference"
    if backend == "cuda" and device_type != "cuda":
        raise ValueError("the cuda kernels need a CUDA device")
    if backend == "cpu":
        if device_type != "cpu":
            raise ValueError("the cpu kernels run on the CPU")
        if not cpu_kernels_available():
            from .cpu_build import unavailable_reason

            raise ValueError(f"the cpu kernels are not available: {unavailable_reason()}")
    return backend


def cpu_kernels_available() -> bool:
    """Whether the CPU's native kernels are built (or build now: a C compiler is on PATH)."""
    from .cpu_build import load

    return load() is not None


def get_ops(backend: str = "reference", config: KernelConfig | None = None) -> OpSet:
    """The ops of `backend` with `config` bound (None: KernelConfig's defaults; the reference takes no
    config: it has one way to compute each op). Imports torch."""
    from .config import DEFAULT
    from .op_set import OpSet

    config = DEFAULT if config is None else config
    if backend == "reference":
        from . import reference

        return OpSet(reference, config)
    if backend == "cuda":
        from . import cuda

        return OpSet(cuda, config)
    if backend == "cpu":
        from . import cpu

        return OpSet(cpu, config)
    raise ValueError(f"unknown kernel backend {backend!r}; available: {', '.join(BACKENDS)}")
