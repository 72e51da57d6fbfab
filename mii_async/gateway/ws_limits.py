"""WebSocket limits of one gateway: open connections, in total and per client address, and idle connections.

    max_websockets          open WebSockets; a new one beyond is closed with 1013 (try again later) and a reason,
    max_websockets_per_ip   right after its handshake
    ws_idle_timeout_s       a WebSocket with no client message and no live request for this long is closed with
                            1001 (going away) and a reason

A refused WebSocket is accepted, then closed, rather than answered 503 before the handshake: a browser hides a
failed handshake's status from the page (its close event says 1006 and nothing more), while a close after
accept reaches the page as 1013 with its reason; the `websockets` client reports either clearly (InvalidStatus
503, or ConnectionClosedError 1013 with the reason).

Protocol pings and pongs are answered by uvicorn's WebSocket layer and never reach the app, so they do not keep a
connection from being idle; a client message of any kind (the JSON "ping" included) does.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Callable

from fastapi import WebSocket

from ..config import HttpConfig
from .connection_limits import ConnectionCounts
from .metrics import Metrics

CLOSE_TRY_AGAIN = 1013          # too many WebSockets: try again later
CLOSE_IDLE = 1001               # going away: the server ends an idle connection, as for a restart


class WebSocketLimits:
    """The WebSocket counts of one app, made at its first WebSocket (`of`); the gauge mii_async_websockets
    reads them."""

    def __init__(self, config: HttpConfig, metrics: Metrics) -> None:
        self.counts = ConnectionCounts(config.max_websockets, config.max_websockets_per_ip, "max_websockets",
                                       "max_websockets_per_ip")
        self.idle_timeout_s = float(config.ws_idle_timeout_s)
        self.metrics = metrics
        metrics.websockets.set_function(lambda: self.counts.total)

    @classmethod
    def of(cls, app: Any) -> WebSocketLimits:
        limits = getattr(app.state, "websocket_limits", None)
        if limits is None:
            gateway = app.state.gateway
            limits = app.state.websocket_limits = cls(gateway.config, gateway.metrics)
        return limits

    @contextlib.asynccontextmanager
    async def slot(self, ws: WebSocket) -> AsyncIterator[bool]:
        """Yields True holding a slot for `ws`, given back on exit; or False when a bound refuses it, after
        accepting and closing it (1013, the reason naming the bound)."""
        ip = ws.client.host if ws.client else ""
        bound = self.counts.admit(ip)
        if bound is None:
            try:
                yield True
            finally:
                self.counts.release(ip)
            return
        self.metrics.connections_limited.labels(bound).inc()
        reason = self.counts.refusal(bound, ip).replace("connections", "WebSockets")
        with contextlib.suppress(Exception):     # the client may be gone already; it was refused either way
            await ws.accept()
            await asyncio.wait_for(ws.close(CLOSE_TRY_AGAIN, reason[:120]), 5.0)
        yield False

    def idle_clock(self, busy: Callable[[], bool]) -> IdleClock:
        return IdleClock(self.idle_timeout_s, busy, lambda: self.metrics.connections_limited.labels(
            "ws_idle_timeout_s").inc())


class IdleClock:
    """When one WebSocket last showed activity: a client message (`touch`), or the end of one of its requests.
    `busy()` says whether a request is live; while one is, the connection is not idle."""

    def __init__(self, timeout_s: float, busy: Callable[[], bool], on_expired: Callable[[], None]) -> None:
        self.timeout_s, self.busy, self.on_expired = timeout_s, busy, on_expired
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()
        self.expired = False

    def touch(self) -> None:
        self.last = self.loop.time()

    async def wait(self) -> None:
        """Returns once the connection has been idle for timeout_s (and sets `expired`)."""
        while True:
            left = self.last + self.timeout_s - self.loop.time()
            if left <= 0 and not self.busy():
                self.expired = True
                self.on_expired()
                return
            # a live request: look again a timeout later; its end touches the clock
            await asyncio.sleep(left if left > 0 else self.timeout_s)

    async def close(self, ws: WebSocket) -> None:
        """Closes an expired connection with 1001 and the reason."""
        with contextlib.suppress(Exception):     # the peer is stuck or gone; uvicorn drops the connection
            await asyncio.wait_for(ws.close(CLOSE_IDLE, f"idle for {self.timeout_s:g} s: no message and no live "
                                            "request (ws_idle_timeout_s)"), 5.0)
