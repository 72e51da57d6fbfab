"""The threads and loops behind an AsyncClient: the sync facade's private loop thread, and how a client's
sockets, its ZeroMQ context and that loop are let go when it closes (from whichever thread closes it)."""
from __future__ import annotations

import asyncio
import threading

import zmq.asyncio

from .client_connection import Connection
from .transport import DealerSocket


def release(ctx: zmq.asyncio.Context, socks: list[DealerSocket]) -> None:
    for sock in socks:
        sock.close()
    ctx.term()


def close_then_set(conn: Connection, closed: threading.Event) -> None:
    try:
        conn.close()
    finally:
        closed.set()


def term_after(ctx: zmq.asyncio.Context, closing: list[threading.Event], timeout_s: float = 5.0) -> None:
    for closed in closing:
        closed.wait(timeout_s)
    ctx.term()


async def stop_when_idle(timeout_s: float = 5.0) -> None:
    """Stops the running loop once its other tasks are done (at most `timeout_s` from now)."""
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    deadline = loop.time() + timeout_s
    while (others := [t for t in asyncio.all_tasks() if t is not me]) and loop.time() < deadline:
        await asyncio.wait(others, timeout=deadline - loop.time())
    await asyncio.sleep(0)            # the finished coroutines' results reach their threads first
    loop.stop()


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The sync facade's loop thread: runs until close() stops it, then frees the loop's descriptors."""
    loop.run_forever()
    loop.close()
