"""A client's connection per event loop: one DEALER socket to the router, the task that reads it and routes
each message to its stream's queue or its query's future, the pinger that tells a silent router from a
busy one, and the watcher of the socket's connection events. AsyncClient (async_client.py) holds one per loop
that uses it; the connection knows the client only through its ConnectionConfig and the ZeroMQ context it
shares.

Liveness, two ways. A router that exits (crashed, killed, stopped) closes its TCP connection: libzmq reports
the disconnect at once, and every open stream and query fails with UnavailableError, as does every new request
until a router answers on the address again (libzmq reconnects by itself; its handshake ends the outage). A
router that hangs keeps the connection open: pings unanswered for `liveness_timeout_s` fail what is
outstanding."""
from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, TypeVar

import zmq
import zmq.asyncio

from . import protocol as P
from .errors import InvalidParameterError, UnavailableError, error_from_code
from .transport import DealerSocket

log = logging.getLogger("mii_async.client")
T = TypeVar("T")
ABORT_LINGER_S = 1.0       # how long a closed connection's last Aborts may take to leave
DRAIN_S = 0.5              # on a disconnect, how long what the router sent before it may take to be read


@dataclass(frozen=True)
class ConnectionConfig:
    """What every connection of one client shares."""
    address: str                   # the router's clients' socket, "tcp://host:port"
    curve_dir: str | None = None   # CURVE keys (`mii-async keys DIR`); None: no encryption
    ping_s: float = 2.0            # ping period while requests are outstanding
    timeout_s: float = 30.0        # the longest a request waits on a router that does not answer; bounds each send
    # Pings unanswered this long (capped by timeout_s) fail what is outstanding: the router hangs, or its host
    # or the network went away without closing the connection (an exited router is seen at once, by the
    # disconnect). Several ping periods, so that a router loop busy for a moment is not taken for dead.
    liveness_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("ping_s", "timeout_s", "liveness_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidParameterError(name, f"must be a positive number of seconds, got {v!r}")

    @property
    def silence_s(self) -> float:
        """How long a router may be silent, while requests are outstanding, before they fail."""
        return min(self.timeout_s, self.liveness_timeout_s)


class Lost(Exception):
    """Put in a stream's queue when the router stopped answering."""


class Connection:
    """One event loop's socket to the router, its reader and its pinger."""

    def __init__(self, config: ConnectionConfig, ctx: zmq.asyncio.Context, loop: asyncio.AbstractEventLoop) -> None:
        """Connects a socket of `ctx` (the client's) and starts the reader and the pinger on `loop`, the loop
        that will use it."""
        self.config, self.loop = config, loop
        self.sock = DealerSocket(ctx, config.address, identity=f"c-{uuid.uuid4().hex}".encode(),
                                 curve_dir=config.curve_dir, monitored=True)
        self.streams: dict[str, asyncio.Queue] = {}
        self.queries: dict[str, asyncio.Future] = {}
        self.last_heard = time.monotonic()
        self.busy_since = time.monotonic()
        # Why the router counts as gone (its connection closed, or it refused ours): every request fails with
        # this at once until a connection to it completes a handshake again. None: reachable, or not known yet
        # (a client made before its router is up waits for it, as a request sent then does).
        self.down: str | None = None
        self._refused = asyncio.Event()       # a handshake was refused: _look_for_keys looks for new keys
        # Each stream's place in the order of sends, once its request is sent; each ping in flight's place:
        # a ping's answer lists the requests the router holds for us, so a stream sent before the ping and
        # missing from the list is one the router lost (it restarted on the same address).
        self.sent_at: dict[str, int] = {}
        self._sends = itertools.count()
        self._pings = itertools.count()
        self._ping_marks: dict[str, int] = {}
        self._missed: dict[str, int] = {}     # pings in a row whose answer left a stream out
        self._told: set[str] = set()          # streams given their Lost (once: one nobody reads would pile them)
        self._bg: dict[asyncio.Task, P.Message] = {}   # `send_later`'s sends in flight, and what each sends
        self.tasks = [loop.create_task(self._read()), loop.create_task(self._ping()), loop.create_task(self._watch()),
                      loop.create_task(self._look_for_keys())]

    def outstanding(self) -> bool:
        return bool(self.streams or self.queries)

    def check_up(self) -> None:
        """Raises UnavailableError, before anything is sent, while the router is known to be gone."""
        if self.down is not None:
            raise UnavailableError(self.down)

    def mark_down(self, err: str) -> None:
        """The router is gone (`err` says how): what is outstanding fails now, and every request after it at
        once, until a connection to a router on the address completes its handshake."""
        self.down = err
        self.fail_all(err)

    def _start_request(self) -> None:
        if not self.outstanding():
            self.busy_since = time.monotonic()

    def open_stream(self, req_id: str) -> asyncio.Queue:
        """The queue that the stream `req_id`'s Deltas, ErrorReply or Lost will arrive in."""
        self._start_request()
        q: asyncio.Queue = asyncio.Queue()
        self.streams[req_id] = q
        return q

    def open_query(self, req_id: str) -> asyncio.Future:
        """The future that the QueryReply for `req_id` (or its error) will be set on."""
        self._start_request()
        fut = self.loop.create_future()
        self.queries[req_id] = fut
        return fut

    def end_query(self, req_id: str) -> None:
        self.queries.pop(req_id, None)

    def sent(self, req_id: str) -> None:
        """A stream's request went out (after every ping sent before it, before every later one)."""
        self.sent_at[req_id] = next(self._sends)

    def end_stream(self, req_id: str) -> None:
        self.streams.pop(req_id, None)
        self.sent_at.pop(req_id, None)
        self._missed.pop(req_id, None)
        self._told.discard(req_id)

    def _lose(self, req_id: str, err: str) -> None:
        """Tells a stream that the router lost it or went silent, once."""
        if req_id not in self._told:
            self._told.add(req_id)
            self.streams[req_id].put_nowait(Lost(err))

    def send_later(self, msg: P.Message) -> None:
        """Sends from code that must not await (a `finally` during cancellation)."""
        task = self.loop.create_task(self.sock.send(msg))
        self._bg[task] = msg
        task.add_done_callback(self._sent_later)

    def _sent_later(self, task: asyncio.Task) -> None:
        self._bg.pop(task, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.debug("a deferred send failed: %s", exc)     # (retrieved: no "never retrieved" at collection)

    async def _read(self) -> None:
        while True:
            msg = await self.sock.recv()
            self.last_heard = time.monotonic()
            if isinstance(msg, P.DeltaBatch):
                for d in msg.deltas:
                    if (q := self.streams.get(d.req_id)) is not None:
                        q.put_nowait(d)
            elif isinstance(msg, (P.Delta, P.ErrorReply)) and msg.req_id in self.streams:
                self.streams[msg.req_id].put_nowait(msg)
            elif isinstance(msg, P.ErrorReply) and msg.req_id in self.queries:
                fut = self.queries.pop(msg.req_id)
                if not fut.done():
                    fut.set_exception(error_from_code(msg.code, msg.message, msg.param))
            elif isinstance(msg, P.QueryReply):
                fut = self.queries.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.result)
                elif (mark := self._ping_marks.pop(msg.req_id, None)) is not None:
                    self._check_live(mark, msg.result.get("live"))
            elif isinstance(msg, P.ErrorReply) and msg.req_id is None:
                log.warning("router: %s: %s", msg.code, msg.message)

    async def _send_ping(self) -> None:
        ping_id = f"ping-{next(self._pings)}"
        self._ping_marks[ping_id] = next(self._sends)    # streams sent before this mark are in the answer
        await self.sock.send(P.Query(req_id=ping_id, what="ping"))

    def _check_live(self, mark: int, live: object) -> None:
        """A router restarted on the same address answers pings but never heard of the requests sent to the
        one before: they would wait for ever. A stream left out of two answers in a row is told it is lost
        (one answer may come between the router forgetting a finished request and its last chunk)."""
        if not isinstance(live, list):
            return
        known = set(live)
        for req_id, at in list(self.sent_at.items()):
            if at >= mark or req_id in known or req_id not in self.streams:
                self._missed.pop(req_id, None)
                continue
            self._missed[req_id] = self._missed.get(req_id, 0) + 1
            if self._missed[req_id] >= 2:
                self._lose(req_id, f"the router at {self.config.address} does not know this request: it "
                                   "restarted (or lost it) since the request was sent")
                self.sent_at.pop(req_id)

    async def _ping(self) -> None:
        c = self.config
        pending: asyncio.Task | None = None
        while True:
            await asyncio.sleep(c.ping_s)
            if not self.outstanding() or self.down is not None:   # (a ping now would wait for the next router)
                continue
            if time.monotonic() - max(self.last_heard, self.busy_since) > c.silence_s:
                self.fail_all(f"the router at {c.address} has not answered for {c.silence_s:g} s")
                continue
            if pending is None or pending.done():     # a send blocks while no connection is up
                pending = self.loop.create_task(self._send_ping())

    async def _watch(self) -> None:
        address = self.config.address
        async for event in self.sock.events():
            if event == "up":
                if self.down is not None:
                    log.info("the router at %s answers again", address)
                self.down = None
                self.last_heard = time.monotonic()
            elif event == "refused" and self.sock.refresh_credentials():
                log.info("the deployment at %s has new keys: reconnecting with them", address)
            elif event == "refused":
                self._refused.set()
                self.mark_down(f"the router at {address} refused this client's connection: the handshake "
                               "failed (CURVE keys it does not accept, or encryption on one side only)")
            elif self.down is None:
                # What the router sent before it went is read first: a stream whose last chunk arrived
                # just before the disconnect ends as it should, not as lost.
                deadline = time.monotonic() + DRAIN_S
                while self.sock.pending() and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                if self.down is None:
                    log.info("the router at %s closed its connection", address)
                    self.mark_down(f"the router at {address} is not answering: its connection closed (the "
                                   "router exited or restarted)")

    async def _look_for_keys(self) -> None:
        """After a refused handshake, looks for the deployment's keys again every second while the router
        counts as gone: a deployment restarted on the address publishes its new keys just after it binds, so the
        first look may come too early (libzmq does not retry a refused handshake by itself)."""
        while True:
            await self._refused.wait()
            self._refused.clear()
            while self.down is not None:
                await asyncio.sleep(1.0)
                if self.sock.refresh_credentials():
                    log.info("the deployment at %s has new keys: reconnecting with them", self.config.address)
                    break

    def fail_all(self, err: str) -> None:
        self._ping_marks.clear()
        for req_id in self.streams:
            self._lose(req_id, err)
        for fut in self.queries.values():
            if not fut.done():
                fut.set_exception(UnavailableError(err))
        self.queries.clear()

    async def send(self, msg: P.Message) -> None:
        """Sends, or raises UnavailableError at once while the router is known to be gone (check_up), or when
        no connection to it comes up within timeout_s."""
        self.check_up()
        try:
            await within(self.sock.send(msg), self.config.timeout_s)
        except asyncio.TimeoutError:
            raise UnavailableError(f"could not reach the router at {self.config.address} "
                                   f"within {self.config.timeout_s:g} s") from None

    def close(self) -> None:
        """Fails what is outstanding and closes the socket, on this connection's loop. The router is told to
        abort every stream still open (not left to run until it misses our pings, client_timeout_s later): the
        Aborts get ABORT_LINGER_S to leave, during which the context's term() waits."""
        live = list(self.streams)
        self.fail_all("the client was closed")
        # `send_later`'s sends not made yet (a stream's Abort as it ended): made now, as the socket closes under
        # them (a send task run after it would fail, and its Abort be lost).
        later = [msg for t, msg in self._bg.items() if not t.done()]
        for t in [*self.tasks, *self._bg]:
            if not self.loop.is_closed():        # (a loop closed with them pending cannot take the cancel)
                t.cancel()
        sent = [m for m in [*(P.Abort(req_id=req_id) for req_id in live), *later] if self.sock.send_nowait(m)]
        self.sock.close(linger_s=ABORT_LINGER_S if sent else 0.0)


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """`await aw` with a timeout (asyncio.TimeoutError), cancellable at every point. Python 3.11's
    `asyncio.wait_for` returns the result, swallowing a cancel, when the task is cancelled just as `aw`
    completes: a stream cancelled right after it sent its request would then run to the end. `asyncio.timeout`
    (3.11+) does not."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await aw
    return await asyncio.wait_for(aw, timeout_s)
