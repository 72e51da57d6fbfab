"""Errors as HTTP answers, in OpenAI's error format: {"error": {"message", "type", "param", "code"}}.

    400 invalid_request_error   a bad or unknown parameter (named in "param"), a prompt that can never fit
    401 authentication_error    a missing or wrong API key
    404 not_found_error         an unknown model or deployment name
    413 invalid_request_error   a body over max_body_bytes
    503 overloaded / unavailable   the queue is full, or no replica is ready (retry later)
    500 internal_error          a request that failed in the engine
"""
from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse

from ..errors import (InvalidParameterError, ModelNotFoundError, OverloadedError, PermissionDeniedError,
                      UnavailableError, error_code)


class HTTPError(Exception):
    """Raised by routes; answered by the app's handler in OpenAI's format."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.counted = False          # True once the request's stream counted it in the metrics

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


async def refuse_scope(err: HTTPError, scope: dict, receive: Any, send: Any, close_reason: str) -> None:
    """Answers an HTTP or WebSocket scope with `err` before the app sees it (the pure-ASGI middlewares: API key,
    Host). A WebSocket handshake gets the same status and JSON body where the server supports ASGI's
    websocket.http.response extension; elsewhere a close (1008, `close_reason`)."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    await receive()                                        # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": err.status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": close_reason})


def bad_request(param: str | None, message: str) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", param, "invalid_parameter")


def from_exception(exc: BaseException, rename: dict[str, str] | None = None, counted: bool = False) -> HTTPError:
    """The HTTP answer for an error of mii_async; `rename` maps our parameter names to the API's own
    (max_new_tokens → max_tokens) so that "param" names what the caller sent. `counted`: the request's stream
    already counted it in the metrics."""
    err = _from_exception(exc, rename)
    err.counted = counted
    return err


def _from_exception(exc: BaseException, rename: dict[str, str] | None) -> HTTPError:
    code = error_code(exc)
    if isinstance(exc, InvalidParameterError):
        param = (rename or {}).get(exc.param, exc.param)
        message = str(exc)
        for ours, theirs in (rename or {}).items():      # the message says what the caller sent, too
            # not "the prompt's 9001 tokens" → "the messages's …": a possessive stays the plain word
            message = re.sub(rf"\b{re.escape(ours)}\b(?!')", theirs, message)
        return HTTPError(400, message, "invalid_request_error", param, code)
    if isinstance(exc, ModelNotFoundError):
        return HTTPError(404, str(exc), "not_found_error", "model", code)
    if isinstance(exc, PermissionDeniedError):
        return HTTPError(403, str(exc), "permission_error", None, code)
    if isinstance(exc, OverloadedError):
        return HTTPError(503, str(exc), "overloaded_error", None, code)
    if isinstance(exc, UnavailableError):
        return HTTPError(503, str(exc), "service_unavailable_error", None, code)
    return HTTPError(500, str(exc) or type(exc).__name__, "internal_error", None, code)
