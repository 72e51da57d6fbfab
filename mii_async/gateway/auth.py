"""API-key check for every route, the WebSocket included: an ASGI middleware in front of the whole app.

The key may come as `Authorization: Bearer KEY` (what the openai package sends), `X-API-Key: KEY`, or the
query parameter `api_key=KEY` (browsers cannot set headers on a WebSocket, and the chat page passes on the key
of its own address). It is compared in constant time (hmac.compare_digest). A missing or wrong key gets 401 in
OpenAI's error format — for a WebSocket, as the HTTP answer to its handshake.
"""
from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from .http_errors import HTTPError, refuse_scope

_DENIED = HTTPError(401, "a valid API key is required: send 'Authorization: Bearer KEY'", "authentication_error",
                    None, "invalid_api_key")


def presented_key(scope: dict) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
        elif name == b"x-api-key":
            return value.decode("latin-1").strip()
    qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return qs["api_key"][0] if qs.get("api_key") else None


def key_matches(presented: str | None, expected: str) -> bool:
    # compare_digest on bytes is constant time for equal lengths and leaks only the length otherwise.
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


class APIKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or key_matches(presented_key(scope), self.api_key):
            await self.app(scope, receive, send)
            return
        await refuse_scope(_DENIED, scope, receive, send, "a valid API key is required")
