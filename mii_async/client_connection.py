"""A client's connection per event loop: one DEALER socket to the router, the task that reads it and routes
each message to its stream's queue or its query's future, and the pinger that tells a silent router from a
busy one (AsyncClient, async_client.py, holds one per loop that uses it)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time
import uuid
from typing import TYPE_CHECKING, Awaitable, TypeVar

from . import protocol as P
from .errors import UnavailableError, error_from_code
from .transport import DealerSocket

if TYPE_CHECKING:
    from .async_client import AsyncClient

log = logging.getLogger("mii_async.client")
T = TypeVar("T")


class Lost(Exception):
    """Put in a stream's queue when the router stopped answering."""


class Connection:
    """One event loop's socket to the router, its reader and its pinger."""

    def __init__(self, client: AsyncClient, loop: asyncio.AbstractEventLoop) -> None:
        self.client, self.loop = client, loop
        self.sock = DealerSocket(client._ctx, client.address, identity=f"c-{uuid.uuid4().hex}".encode(),
                                 curve_dir=client.curve_dir)
        self.streams: dict[str, asyncio.Queue] = {}
        self.queries: dict[str, asyncio.Future] = {}
        self.last_heard = time.monotonic()
        self.busy_since = time.monotonic()
        self.boot: str | None = None       # the router's life, from its pings' answers (router.boot)
        self._pings = itertools.count()
        self._bg: set[asyncio.Task] = set()
        self.tasks = [loop.create_task(self._read()), loop.create_task(self._ping())]

    def outstanding(self) -> bool:
        return bool(self.streams or self.queries)

    def start_request(self) -> None:
        if not self.outstanding():
            self.busy_since = time.monotonic()
        if self.boot is None:                  # learn the router's life before it could end
            self.send_later(self._ping_query())

    def send_later(self, msg: P.Message) -> None:
        """Sends from code that must not await (a `finally` during cancellation)."""
        task = self.loop.create_task(self.sock.send(msg))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

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
                elif msg.req_id.startswith("ping-") and isinstance(boot := msg.result.get("boot"), str):
                    self._on_boot(boot)
            elif isinstance(msg, P.ErrorReply) and msg.req_id is None:
                log.warning("router: %s: %s", msg.code, msg.message)

    def _ping_query(self) -> P.Query:
        return P.Query(f"ping-{next(self._pings)}", "ping")

    def _on_boot(self, boot: str) -> None:
        """A router that answers with another life than the one this connection knew restarted (a crash, then
        a new router on the same address): it never heard of the requests in flight, which would wait
        forever on a router that answers pings."""
        if self.boot is not None and boot != self.boot:
            self.fail_all(f"the router at {self.client.address} restarted: the requests in flight were lost")
        self.boot = boot

    async def _ping(self) -> None:
        c = self.client
        pending: asyncio.Task | None = None
        while True:
            await asyncio.sleep(c.ping_s)
            if not self.outstanding():
                continue
            if time.monotonic() - max(self.last_heard, self.busy_since) > c.timeout_s:
                self.fail_all(f"the router at {c.address} has not answered for {c.timeout_s:.0f} s")
                continue
            if pending is None or pending.done():     # a send blocks while no connection is up
                pending = self.loop.create_task(self.sock.send(self._ping_query()))

    def fail_all(self, err: str) -> None:
        for q in self.streams.values():
            q.put_nowait(Lost(err))
        for fut in self.queries.values():
            if not fut.done():
                fut.set_exception(UnavailableError(err))
        self.queries.clear()

    async def send(self, msg: P.Message) -> None:
        """Sends, or raises UnavailableError when no connection to the router comes up within timeout_s."""
        try:
            await within(self.sock.send(msg), self.client.timeout_s)
        except asyncio.TimeoutError:
            raise UnavailableError(f"could not reach the router at {self.client.address} "
                                   f"within {self.client.timeout_s:.0f} s") from None

    def close(self) -> None:
        self.fail_all("the client was closed")
        for t in self.tasks:
            t.cancel()
        self.sock.close()


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """`await aw` with a timeout (asyncio.TimeoutError), cancellable at every point. Python 3.11's
    `asyncio.wait_for` returns the result, swallowing a cancel, when the task is cancelled just as `aw`
    completes: a stream cancelled right after it sent its request would then run to the end. `asyncio.timeout`
    (3.11+) does not."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await aw
    return await asyncio.wait_for(aw, timeout_s)
