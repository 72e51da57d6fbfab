"""Typed ZeroMQ sockets over real loopback TCP: round trips, bad frames counted, oversize frames dropped."""
from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from mii_async import protocol as p
from mii_async.transport import DealerSocket, RouterSocket


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_round_trip_over_loopback():
    """A DEALER's message reaches the ROUTER with its peer id, and the reply comes back to that DEALER."""
    async def main():
        ctx = zmq.asyncio.Context()
        router = RouterSocket(ctx, "tcp://127.0.0.1:*")
        dealer = DealerSocket(ctx, router.address)
        try:
            await dealer.send(p.Generate(req_id="r1", prompt="hi"))
            got = await router.recv()
            assert got.message == p.Generate(req_id="r1", prompt="hi")
            await router.send(got.peer, p.Delta(req_id="r1", text="hello", token_ids=[1, 2]))
            assert await dealer.recv() == p.Delta(req_id="r1", text="hello", token_ids=[1, 2])
        finally:
            dealer.close(), router.close(), ctx.term()

    _run(main())


def test_bad_and_oversize_frames_never_stop_the_receiver():
    """A malformed frame is returned as a counted ProtocolError; an oversize one is dropped by libzmq; the
    socket keeps serving the next valid message."""
    async def main():
        ctx = zmq.asyncio.Context()
        router = RouterSocket(ctx, "tcp://127.0.0.1:*")
        raw = ctx.socket(zmq.DEALER)
        raw.connect(router.address)
        try:
            await raw.send(b"\xc1 not msgpack")
            got = await router.recv()
            assert isinstance(got.message, p.ProtocolError) and router.bad_frames == 1
            await raw.send(b"x" * (p.MAX_FRAME_BYTES + 10))      # libzmq disconnects this peer
            good = DealerSocket(ctx, router.address)
            await good.send(p.Abort(req_id="r9"))
            got = await router.recv()
            assert got.message == p.Abort(req_id="r9")
            good.close()
        finally:
            raw.close(linger=0), router.close(), ctx.term()

    _run(main())
