"""WebSocket streaming at /v1/ws: many concurrent requests on one connection (docs/websocket.md).

    → {"type": "generate", "id": "a", "prompt": "…" | "messages": [...], "max_new_tokens": 64, …}
    ← {"type": "token", "id": "a", "text": "…", "token_ids": [...]}        per streamed step (+ logprobs, and
                                                                           prompt_logprobs on the first, when asked)
    ← {"type": "done", "id": "a", "finish_reason": "stop", "usage": {...}}
    → {"type": "cancel", "id": "a"}       ← {"type": "done", "id": "a", "finish_reason": "abort", …}
    ← {"type": "error", "id": "a" | null, "code": "…", "message": "…", "param": "…" | null}

Each connection has one writer and a bounded send queue: a reader too slow for what it asked for fills the
queue, and the connection is closed (1013) rather than letting server memory grow. A disconnect, or that
close, cancels every request of the connection, so their KV blocks are freed within a step. A malformed
frame gets an error frame; the connection stays up. uvicorn pings every ws_ping_s and bounds frame size.
Open WebSockets are bounded in total and per client address, and an idle one is closed (ws_limits.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, WebSocket

from ..errors import InvalidParameterError, MIIAsyncError, UnavailableError, error_code
from ..outputs import StreamChunk
from ..params import SamplingParams
from ..text.unicode_text import check_json_text, lone_surrogate
from .state import GatewayState
from .ws_limits import WebSocketLimits

log = logging.getLogger("mii_async.gateway.ws")
router = APIRouter()
WS_PROTOCOL = 1
CLOSE_TOO_SLOW = 1013            # "try again later": the client did not read fast enough


@router.websocket("/v1/ws")
async def websocket_endpoint(ws: WebSocket) -> None:
    state: GatewayState = ws.app.state.gateway
    origin = ws.headers.get("origin")
    if origin is not None and not origin_allowed(origin, ws):
        # Browsers send Origin and let any page open a WebSocket anywhere: without this check, a page of
        # another site could drive a gateway on the visitor's loopback. The Host is no guide (a rebound name
        # makes evil.example's Origin and Host agree), so the Origin must name an allowed host or be listed.
        # Tools that send no Origin are let in.
        log.warning("refused a WebSocket from Origin %r (allowed: loopback, this gateway's address, hosts %s, "
                    "origins %s)", origin, list(state.config.allowed_hosts), list(state.config.allowed_origins))
        await ws.close(code=1008)             # before accept: the handshake is answered 403
        return
    async with WebSocketLimits.of(ws.app).slot(ws) as admitted:       # max_websockets(_per_ip): else 1013
        if admitted:
            await WsConnection(state, ws).run()


def origin_allowed(origin: str, ws: WebSocket) -> bool:
    """Listed in allowed_origins (or "*" there), or an http(s) Origin whose host is an allowed host."""
    listed = ws.app.state.gateway.config.allowed_origins
    if "*" in listed or origin.rstrip("/") in listed:
        return True
    return ws.app.state.allowed_hosts.allows_origin(origin, ws.scope.get("server"))


class _Overflow(Exception):
    pass


class WsConnection:
    def __init__(self, state: GatewayState, ws: WebSocket) -> None:
        self.state, self.ws = state, ws
        self.out: asyncio.Queue[tuple[str, int]] = asyncio.Queue(maxsize=state.config.ws_send_queue)
        self.queued_bytes = 0           # the UTF-8 size of the frames in `out` (each queued with its size)
        self.live: dict[Any, asyncio.Task] = {}
        self.sent: dict[Any, int] = {}   # tokens sent per live request, for an abort frame's usage
        self.closing = False
        self.overflow = asyncio.Event()
        self.idle = WebSocketLimits.of(ws.app).idle_clock(lambda: bool(self.live))    # ws_idle_timeout_s

    async def run(self) -> None:
        await self.ws.accept()
        cfg = self.state.config
        self.put({"type": "hello", "protocol": WS_PROTOCOL, "model": self.state.model_name,
                  "max_message_bytes": cfg.ws_max_message_bytes, "max_requests": cfg.ws_max_requests})
        tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._write()),
                 asyncio.ensure_future(self.overflow.wait()), asyncio.ensure_future(self.idle.wait())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.closing = True
            live = list(self.live.values())
            for t in live + tasks:
                t.cancel()
            await asyncio.gather(*live, *tasks, return_exceptions=True)
        if self.overflow.is_set():
            log.warning("closing a WebSocket: its send queue is full (%d frames or %d bytes)", cfg.ws_send_queue,
                        cfg.ws_send_queue_bytes)
            try:
                await asyncio.wait_for(self.ws.close(CLOSE_TOO_SLOW, "send queue full: the client reads too slowly"), 5.0)
            except Exception:  # noqa: BLE001 - the peer is stuck or gone; uvicorn drops the connection
                pass
        elif self.idle.expired:
            await self.idle.close(self.ws)

    def put(self, frame: dict) -> None:
        if self.closing:
            return
        text = json.dumps(frame, ensure_ascii=False, separators=(",", ":"))
        size = len(text.encode())
        try:
            # a frame larger than the byte bound alone still goes out when nothing waits before it
            if self.queued_bytes and self.queued_bytes + size > self.state.config.ws_send_queue_bytes:
                raise asyncio.QueueFull
            self.out.put_nowait((text, size))
        except asyncio.QueueFull:
            self.closing = True
            self.overflow.set()
            return
        self.queued_bytes += size

    async def _write(self) -> None:
        while True:
            text, size = await self.out.get()
            self.queued_bytes -= size
            await self.ws.send_text(text)

    async def _read(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            self.idle.touch()
            if msg.get("text") is None:
                self._error(None, "invalid_message", "frames must be JSON text, not binary")
                continue
            try:
                frame = json.loads(msg["text"])
            except ValueError as exc:
                self._error(None, "invalid_json", f"not JSON: {exc}")
                continue
            except RecursionError:      # "[[[[…" within the size limit: it must not end the connection
                self._error(None, "invalid_json", "not JSON that can be read: nested too deeply")
                continue
            try:
                check_json_text(msg["text"], frame)     # a lone surrogate would break this frame's answers too
            except InvalidParameterError as exc:
                req_id = frame.get("id") if isinstance(frame, dict) else None
                if lone_surrogate(req_id, "") is not None or isinstance(req_id, (dict, list)):
                    req_id = None
                (self._refuse if isinstance(frame, dict) and frame.get("type") == "generate" else self._error)(
                    req_id, "invalid_parameter", str(exc), exc.param)
                continue
            self._on_frame(frame)

    def _error(self, req_id: Any, code: str, message: str, param: str | None = None) -> None:
        self.put({"type": "error", "id": req_id, "code": code, "message": message, "param": param})

    def _refuse(self, req_id: Any, code: str, message: str, param: str | None = None) -> None:
        """An error frame for a generate refused before any stream opened, counted in the metrics."""
        self.state.metrics.requests.labels("ws", code).inc()
        self._error(req_id, code, message, param)

    def _on_frame(self, frame: Any) -> None:
        if not isinstance(frame, dict):
            return self._error(None, "invalid_message", "a frame must be a JSON object")
        kind, req_id = frame.get("type"), frame.get("id")
        if kind == "ping":
            return self.put({"type": "pong", "id": req_id})
        if kind not in ("generate", "cancel"):
            return self._error(req_id, "invalid_message", f"unknown type {kind!r}: generate, cancel or ping", "type")
        if isinstance(req_id, bool) or not isinstance(req_id, (str, int)):
            return self._error(None, "invalid_parameter", "id must be a string or an integer", "id")
        if kind == "cancel":
            task = self.live.get(req_id)
            if task is not None:
                task.cancel()
            return None
        if req_id in self.live:
            return self._refuse(req_id, "invalid_parameter", f"id {req_id!r} is already running", "id")
        if len(self.live) >= self.state.config.ws_max_requests:
            return self._refuse(req_id, "overloaded", f"at most {self.state.config.ws_max_requests} live requests "
                               "per connection")
        params = {k: v for k, v in frame.items() if k not in ("type", "id", "prompt", "messages")}
        has_prompt, has_messages = "prompt" in frame, "messages" in frame
        if has_prompt == has_messages:
            return self._refuse(req_id, "invalid_parameter", "give exactly one of prompt and messages", "prompt")
        prompt = frame["prompt"] if has_prompt else frame["messages"]
        if has_messages and not (isinstance(prompt, list) and prompt):
            return self._refuse(req_id, "invalid_parameter", "messages must be a non-empty list", "messages")
        try:
            SamplingParams.from_kwargs(**params)
        except InvalidParameterError as exc:
            return self._refuse(req_id, "invalid_parameter", str(exc), exc.param)
        task = asyncio.ensure_future(self._generate(req_id, prompt, params))
        self.live[req_id] = task
        task.add_done_callback(lambda t: self._finished(req_id, t))
        return None

    def _finished(self, req_id: Any, task: asyncio.Task) -> None:
        # Here and not in _generate's finally: a cancel that arrives before the task first runs never enters
        # _generate's body, and the id would stay "already running" with no frame sent.
        if self.live.get(req_id) is task:
            del self.live[req_id]
        self.idle.touch()                   # idle from the end of its last request, not from its start
        sent = self.sent.pop(req_id, 0)
        if task.cancelled():
            # A cancel frame (answered with "abort"), or the connection closing (put() then sends nothing).
            self.put({"type": "done", "id": req_id, "finish_reason": "abort",
                      "usage": {"prompt_tokens": None, "completion_tokens": sent}})

    async def _generate(self, req_id: Any, prompt: Any, params: dict[str, Any]) -> None:
        started = False
        try:
            async with aclosing(self.state.metrics.track("ws", self.state.client.stream(prompt, **params))) as chunks:
                async for c in chunks:
                    started = True
                    if c.token_ids or c.text:
                        self.put(_token_frame(req_id, c))
                        self.sent[req_id] = self.sent.get(req_id, 0) + len(c.token_ids)
                    if c.finish_reason == "error":
                        self._error(req_id, "generation_failed", c.error or "generation failed")
                    elif c.finish_reason is not None:
                        self.put({"type": "done", "id": req_id, "finish_reason": c.finish_reason,
                                  "usage": c.usage.to_dict() if c.usage else None})
        except UnavailableError as exc:
            # Once streaming, the request failed mid-way (its router died or lost it), as when its replica dies;
            # before its first chunk it was refused, and may be sent again when the deployment is back.
            self._error(req_id, "generation_failed" if started else error_code(exc), str(exc))
        except MIIAsyncError as exc:
            self._error(req_id, error_code(exc), str(exc), getattr(exc, "param", None))
        except Exception as exc:  # noqa: BLE001 - any failure is the client's error frame, not a silent stop
            log.exception("WebSocket request %r failed", req_id)
            self._error(req_id, "generation_failed", f"{type(exc).__name__}: {exc}")


def _token_frame(req_id: Any, c: StreamChunk) -> dict:
    frame: dict[str, Any] = {"type": "token", "id": req_id, "text": c.text, "token_ids": c.token_ids}
    if c.logprobs:
        frame["logprobs"] = [lp.to_dict() for lp in c.logprobs]
    if c.prompt_logprobs is not None:        # the first token's frame, when asked
        frame["prompt_logprobs"] = [lp and lp.to_dict() for lp in c.prompt_logprobs]
    return frame
