"""OpSet: one backend's ops with a KernelConfig bound, which is what the model holds as `ops`.

A backend module lists in `CONFIGURED` the ops that take `config=`; here each of them is bound to this op
set's config, so model code calls `ops.paged_attention(q, …)` with the backend's signature and the config
reaches the kernels without a module global. Every other name (the remaining ops, `RAGGED_PREFILL`,
`decode_supported`) is the backend module's own. An attribute set on an op set (a probe wrapping an op to
time it) shadows the bound op of that op set only.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from .config import KernelConfig


class OpSet:
    def __init__(self, backend: ModuleType, config: KernelConfig) -> None:
        self.backend = backend            # the module of ops (kernels/reference.py, kernels/cuda.py)
        self.config = config
        for name in getattr(backend, "CONFIGURED", ()):
            setattr(self, name, functools.partial(getattr(backend, name), config=config))

    def __getattr__(self, name: str) -> Any:
        """Called only for names not set on the instance: the backend's. Dunder names are not delegated, so
        copying or pickling an op set cannot recurse here before `backend` is set."""
        if name.startswith("__") or name in ("backend", "config"):
            raise AttributeError(name)
        return getattr(self.backend, name)

    def __repr__(self) -> str:
        return f"OpSet({self.backend.__name__}, {self.config!r})"
