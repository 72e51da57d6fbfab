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
        configured = getattr(backend, "CONFIGURED", ())
        for name in configured:
            setattr(self, name, functools.partial(getattr(backend, name), config=config))
        # The backend's other ops bound here too: a CPU step calls hundreds of ops, each found at once.
        for name, value in vars(backend).items():
            if callable(value) and not name.startswith("_") and name not in configured \
                    and getattr(value, "__module__", None) == backend.__name__:
                setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        """Called only for names not set on the instance: the backend's. Dunder names are not delegated, so
        copying or pickling an op set cannot recurse here before `backend` is set."""
        if name.startswith("__") or name in ("backend", "config"):
            raise AttributeError(name)
        return getattr(self.backend, name)

    def __repr__(self) -> str:
        return f"OpSet({self.backend.__name__}, {self.config!r})"
