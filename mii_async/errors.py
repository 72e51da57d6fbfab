"""Every error that mii_async raises to its callers.

    MIIAsyncError
     ├── InvalidParameterError     a caller's bad value; `.param` names it (HTTP 400)
     │    └── RequestTooLongError   prompt + max_new_tokens can never fit (context or KV pool)
     ├── ModelNotFoundError        a model name that resolves to nothing; says what was tried
     ├── UnsupportedModelError     a model_type the engine does not implement; lists the supported ones
     ├── EngineClosedError         the pipeline/engine was closed
     └── GenerationError           a request failed inside the engine (finish_reason "error")

Our own invariants are `assert`s with a message, never these classes.
"""
from __future__ import annotations


class MIIAsyncError(Exception):
    """Base class of every error mii_async raises to a caller."""


class InvalidParameterError(MIIAsyncError, ValueError):
    """A request or configuration value is invalid; `param` is its name."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(f"{param}: {message}")


class RequestTooLongError(InvalidParameterError):
    """The request can never be served: it exceeds the model's context or the whole KV pool."""


class ModelNotFoundError(MIIAsyncError, FileNotFoundError):
    """A model name or path resolved to nothing."""


class UnsupportedModelError(MIIAsyncError, ValueError):
    """The model's architecture is not implemented."""


class EngineClosedError(MIIAsyncError, RuntimeError):
    """The engine was closed before or while the request ran."""


class GenerationError(MIIAsyncError, RuntimeError):
    """A request failed inside the engine."""
