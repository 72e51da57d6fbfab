"""Server-sent events, and work that stops when the HTTP client goes away.

`EventStream` sends an async iterator of events as `text/event-stream` while watching the connection: when
the client disconnects, the iterator is cancelled at once (not at the next token), so the request is aborted
and its KV blocks freed within a step. `until_disconnect` does the same for a plain JSON answer.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, TypeVar

from fastapi import Request
from starlette.responses import Response

from .http_errors import HTTPError

log = logging.getLogger("mii_async.gateway")
T = TypeVar("T")
DONE = "data: [DONE]\n\n"


def event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _disconnected(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], status_code: int = 200) -> None:
        # Not Response.__init__: it would declare a Content-Length.
        self.status_code = status_code
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump() -> None:
            try:
                try:
                    async for ev in self.events:
                        await send({"type": "http.response.body", "body": ev.encode(), "more_body": True})
                except OSError:
                    raise                                  # the client is gone
                except Exception as exc:  # noqa: BLE001 - a fault of ours in the middle of the stream
                    # The client still gets a well-formed answer (an error event, [DONE], the body's end) rather
                    # than a connection cut inside a chunked body.
                    log.error("an event stream failed", exc_info=exc)
                    err = HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error", None,
                                    "internal_error")
                    await send({"type": "http.response.body", "body": (event(err.body()) + DONE).encode(),
                                "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await self.events.aclose()

        task = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, watch):
                if not t.done():
                    t.cancel()
            results = await asyncio.gather(task, watch, return_exceptions=True)
        exc = results[0]
        if isinstance(exc, Exception) and not isinstance(exc, OSError):   # OSError: the client is gone
            log.error("an event stream failed", exc_info=exc)
