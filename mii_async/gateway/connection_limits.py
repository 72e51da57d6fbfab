"""Connection limits of the gateway's HTTP server: slow and idle clients cannot hold it.

uvicorn's httptools protocol has no bound on the time or the size of a request head, nor on open connections
(its `limit_concurrency` answers 503 only once a whole head has arrived, so a slowloris client still holds its
socket). `GuardedHttpToolsProtocol` adds them to uvicorn's own protocol, at the socket:

    header_timeout_s        a request head (request line and headers) not complete this long after the
                            connection opened, or after its first byte on a kept-alive connection: 408, closed
                            (a connection that sent nothing by then is closed without an answer)
    max_header_bytes        a request head larger than this: 431 before more of it is buffered, closed
    max_connections         open HTTP connections of this server; a new one beyond: 503, closed
    max_connections_per_ip  the same per client address (behind a reverse proxy, every client is the proxy's)

Between requests uvicorn's own keep-alive timeout (`KEEP_ALIVE_S`) closes an idle connection. A connection
upgraded to a WebSocket gives back its HTTP slot: WebSockets have bounds of their own (ws_limits.py).
Each refusal is an answer in OpenAI's error shape with `Connection: close`; the gateway then stops writing and
reads and discards what the client still sends, for at most `LINGER_S`, since closing a socket with unread
bytes makes the kernel reset it, which can destroy the answer before the client reads it.
"""
from __future__ import annotations

import json
import logging
import resource
from typing import Any, Callable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ..config import HttpConfig
from .metrics import Metrics

log = logging.getLogger("mii_async.gateway")
KEEP_ALIVE_S = 5          # uvicorn's timeout_keep_alive: an idle kept-alive connection is closed after this
LINGER_S = 2.0            # after a refusal, how long the client's unread bytes are read and dropped
_HEAD_END = b"\r\n\r\n"


class ConnectionCounts:
    """Open connections of one kind, in total and per client address, each under its bound. One per server,
    shared by its connections; they all run on one event loop, so no lock."""

    def __init__(self, max_total: int, max_per_ip: int, total_name: str, per_ip_name: str) -> None:
        self.max_total, self.max_per_ip = max_total, max_per_ip
        self.total_name, self.per_ip_name = total_name, per_ip_name      # the HttpConfig fields, for messages
        self.total = 0
        self.per_ip: dict[str, int] = {}    # only addresses with an open connection: it cannot grow past them

    def admit(self, ip: str) -> str | None:
        """Takes a slot for a connection from `ip`; None when taken, else the name of the bound that refuses."""
        if self.total >= self.max_total:
            return self.total_name
        held = self.per_ip.get(ip, 0)
        if held >= self.max_per_ip:
            return self.per_ip_name
        self.total += 1
        self.per_ip[ip] = held + 1
        return None

    def release(self, ip: str) -> None:
        """Gives back a slot that admit() took; exactly once per slot."""
        held = self.per_ip.get(ip, 0)
        assert held > 0 and self.total > 0, f"a connection slot of {ip!r} released twice"
        self.total -= 1
        if held == 1:
            del self.per_ip[ip]
        else:
            self.per_ip[ip] = held - 1

    def refusal(self, name: str, ip: str) -> str:
        """The message for a connection that `name` (a bound admit() returned) refused."""
        if name == self.per_ip_name:
            return f"too many connections from {ip or 'this client'}: at most {self.max_per_ip} ({name})"
        return f"too many connections: at most {self.max_total} ({name}); try again later"


class ConnectionGuard:
    """What the protocol instances of one server share: the counts, the head bounds, the metrics hook."""

    def __init__(self, http: HttpConfig, on_limit: Callable[[str], None]) -> None:
        self.counts = ConnectionCounts(http.max_connections, http.max_connections_per_ip, "max_connections",
                                       "max_connections_per_ip")
        self.header_timeout_s = float(http.header_timeout_s)
        self.max_header_bytes = http.max_header_bytes
        self.on_limit = on_limit       # called with the HttpConfig field of each limit that refuses or closes


def _client_ip(client: tuple[str, int] | None) -> str:
    return client[0] if client else ""       # a Unix socket's clients share one slot pool


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds above. Every timer is cancelled when the connection is lost
    or upgraded; the connection's slot is given back there, exactly once (`_slot` is cleared)."""
    guard: ConnectionGuard            # set on the subclass that guarded_protocol() makes for one server

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slot: str | None = None           # the client address whose slot this connection holds
        self._deadline: Any = None              # the head timer (asyncio.TimerHandle) while a head is awaited
        self._linger: Any = None                # the close timer after a refusal
        self._refused = False                   # answered with a refusal: what comes next is dropped
        self._in_head = True                    # between requests or in a head, not in a body
        self._began = False                     # a byte of the current request arrived
        self._head_bytes = 0                    # bytes of the current head received so far
        self._tail = b""                        # the last bytes of the head so far: its end may span two reads

    # -- connection --
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        ip = _client_ip(self.client)
        bound = self.guard.counts.admit(ip)
        if bound is not None:
            self._refuse(503, bound, "overloaded_error", "too_many_connections", self.guard.counts.refusal(bound, ip))
            return
        self._slot = ip
        self._deadline = self.loop.call_later(self.guard.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timers()
        self._give_back()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        # The transport moves to the WebSocket protocol, whose connection_lost is not ours.
        self._stop_timers()
        self._give_back()
        super().handle_websocket_upgrade()

    # -- reading --
    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            room = self.guard.max_header_bytes - self._head_bytes
            # Within the room the head must end; past its end come body bytes, which the head bound leaves be.
            if len(data) > room and (self._tail + data[:max(room, 0)]).find(_HEAD_END) < 0:
                bound = self.guard.max_header_bytes
                self._refuse(431, "max_header_bytes", "invalid_request_error", "headers_too_large",
                             f"the request's headers exceed {bound} bytes (max_header_bytes)")
                return
            self._head_bytes += len(data)
            self._tail = (self._tail + data[-3:])[-3:]
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began = True
        if self._deadline is None:              # a later request of a kept-alive connection: its head's clock
            self._deadline = self.loop.call_later(self.guard.header_timeout_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._cancel_deadline()
        self._in_head, self._head_bytes, self._tail = False, 0, b""
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._began = True, False

    # -- limits --
    def _head_timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if not self._began:                     # nothing sent: no request to answer
            self.guard.on_limit("header_timeout_s")
            self._refused = True
            self.transport.close()
            return
        self._refuse(408, "header_timeout_s", "invalid_request_error", "request_timeout",
                     f"the request's headers did not arrive within {self.guard.header_timeout_s:g} s "
                     "(header_timeout_s)")

    def _refuse(self, status: int, limit: str, type_: str, code: str, message: str) -> None:
        self.guard.on_limit(limit)
        self._refused = True
        self._cancel_deadline()
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head while the previous response is still going out: no answer fits between, so the
            # connection closes when that response ends.
            self.cycle.keep_alive = False
            return
        body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
        head = [STATUS_LINE[status], b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
        if status == 503:
            head.append(b"retry-after: 1\r\n")
        self.transport.write(b"".join(head) + b"\r\n" + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _stop_timers(self) -> None:
        self._cancel_deadline()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None

    def _give_back(self) -> None:
        if self._slot is not None:
            self.guard.counts.release(self._slot)
            self._slot = None


def guarded_protocol(http: HttpConfig, metrics: Metrics) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for one server (uvicorn.Config's `http=`): its connections share one guard, whose
    open count is the gauge mii_async_http_connections. Raises the process's file limit to fit the bounds."""
    guard = ConnectionGuard(http, lambda limit: metrics.connections_limited.labels(limit).inc())
    metrics.http_connections.set_function(lambda: guard.counts.total)
    reserve_file_descriptors(http.max_connections + http.max_websockets)
    return type("GatewayHttpProtocol", (GuardedHttpToolsProtocol,), {"guard": guard})


def reserve_file_descriptors(connections: int, spare: int = 256) -> None:
    """Raises the soft limit on open files to hold `connections` sockets and `spare` others (ZeroMQ, logs),
    up to the hard limit; below it, accept() would fail with EMFILE before the connection bounds act."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + spare
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open-file limit from %d to %d (%s)", soft, target, exc)
        target = soft
    if target < want:
        log.warning("the open-file limit (%d) is below max_connections + max_websockets + %d (%d): lower those "
                    "or raise the limit (ulimit -n)", target, spare, want)
