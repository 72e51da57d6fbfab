"""Every error that mii_async raises to its callers.

    MIIAsyncError
     ├── InvalidParameterError     a caller's bad value; `.param` names it (HTTP 400)
     │    └── RequestTooLongError   prompt + max_new_tokens can never fit (context or KV pool)
     ├── ModelNotFoundError        a model name that resolves to nothing; says what was tried
     ├── UnsupportedModelError     a model_type the engine does not implement; lists the supported ones
     ├── EngineClosedError         the pipeline/engine was closed
     ├── GenerationError           a request failed inside the engine (finish_reason "error")
     ├── OverloadedError           the deployment's request queue is full; retry later (HTTP 503)
     └── UnavailableError          no replica is ready, the router is shutting down or unreachable (HTTP 503)

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


class OverloadedError(MIIAsyncError, RuntimeError):
    """Admission control refused the request: too many queued requests or tokens."""


class UnavailableError(MIIAsyncError, ConnectionError):
    """The deployment cannot take the request now: starting, draining, no live replica, or unreachable."""


class PermissionDeniedError(MIIAsyncError, PermissionError):
    """The caller's credentials do not allow this (a control message from a client key)."""


# The codes that travel in protocol.ErrorReply, and the class each one raises at the caller.
ERROR_CODES: dict[str, type[MIIAsyncError]] = {
    "invalid_parameter": InvalidParameterError,
    "request_too_long": RequestTooLongError,
    "model_not_found": ModelNotFoundError,
    "unsupported_model": UnsupportedModelError,
    "overloaded": OverloadedError,
    "unavailable": UnavailableError,
    "generation_failed": GenerationError,
    "bad_frame": MIIAsyncError,
    "permission_denied": PermissionDeniedError,
}


def error_code(exc: BaseException) -> str:
    """The wire code of an exception (the most specific class listed in ERROR_CODES)."""
    for code, cls in ERROR_CODES.items():
        if type(exc) is cls:
            return code
    for code, cls in ERROR_CODES.items():
        if isinstance(exc, cls) and cls is not MIIAsyncError:
            return code
    return "generation_failed"


def error_from_code(code: str, message: str, param: str | None = None) -> MIIAsyncError:
    """Rebuilds the caller-side exception for an ErrorReply."""
    cls = ERROR_CODES.get(code, MIIAsyncError)
    if issubclass(cls, InvalidParameterError):
        exc = cls.__new__(cls)
        exc.param = param or "request"
        Exception.__init__(exc, message)
        return exc
    return cls(message)
