"""BodyLimitMiddleware: an HTTP request body over `max_bytes` gets 413 before it is read whole, whether it
says its length (Content-Length) or streams in chunks. `on_refuse(path)` counts a refusal made here, before
the app (whose own handlers count the rest)."""
from __future__ import annotations

import json

from starlette.exceptions import HTTPException

from .http_errors import HTTPError


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, on_refuse=None) -> None:
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                if self.on_refuse is not None:
                    self.on_refuse(scope["path"])
                await self._refuse(send)
                return
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Starlette's HTTPException: FastAPI re-raises it from its body parsing (where any
                    # other exception becomes a 400), and the app's handler answers it.
                    raise HTTPException(413, self._message())
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except HTTPException as exc:
            if exc.status_code != 413 or started:
                raise
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        err = HTTPError(413, self._message(), "invalid_request_error", None, "request_too_large")
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _message(self) -> str:
        return f"the request body exceeds {self.max_bytes} bytes"
