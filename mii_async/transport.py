"""Typed async ZeroMQ sockets: business code sends and receives protocol messages, never raw zmq.

Every socket has ZMQ_MAXMSGSIZE set to the protocol's frame limit (libzmq drops a peer that sends more),
linger 0 (closing never blocks on unsent frames) and, for TCP, keepalive. A frame that does not decode is
counted in `bad_frames` and handed to the caller as a ProtocolError, so the receiver can answer it and carry on.
Concurrency: one task may receive while others send; sends are serialised by zmq.asyncio. Closing: `close()`
drops unsent frames.
"""
from __future__ import annotations

from typing import NamedTuple

import zmq
import zmq.asyncio

from . import protocol
from .protocol import Message, ProtocolError


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)


class Received(NamedTuple):
    peer: bytes                            # the sender's routing id (ROUTER sockets), b"" otherwise
    message: Message | ProtocolError       # the message, or why its frame was refused


class RouterSocket:
    """A bound ROUTER socket: many peers, each addressed by its routing id."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        _configure(self._sock)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)   # a frame to a vanished peer is dropped, not an error
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bad_frames = 0

    async def recv(self) -> Received:
        frames = await self._sock.recv_multipart(copy=True)
        if len(frames) != 2:
            self.bad_frames += 1
            return Received(frames[0] if frames else b"", ProtocolError(f"expected 1 payload frame, got {len(frames) - 1}"))
        peer, data = frames
        try:
            return Received(peer, protocol.decode(data))
        except ProtocolError as exc:
            self.bad_frames += 1
            return Received(peer, exc)

    async def send(self, peer: bytes, msg: Message) -> None:
        await self._sock.send_multipart([peer, protocol.encode(msg)])

    def close(self) -> None:
        self._sock.close(linger=0)


class DealerSocket:
    """A connecting DEALER socket: one logical peer (the router)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, identity: bytes | None = None) -> None:
        self._sock = ctx.socket(zmq.DEALER)
        _configure(self._sock)
        if identity is not None:
            self._sock.setsockopt(zmq.IDENTITY, identity)
        self._sock.connect(address)
        self.bad_frames = 0

    async def recv(self) -> Message | ProtocolError:
        frames = await self._sock.recv_multipart(copy=True)
        if len(frames) != 1:
            self.bad_frames += 1
            return ProtocolError(f"expected 1 frame, got {len(frames)}")
        try:
            return protocol.decode(frames[0])
        except ProtocolError as exc:
            self.bad_frames += 1
            return exc

    async def send(self, msg: Message) -> None:
        await self._sock.send(protocol.encode(msg))

    def close(self) -> None:
        self._sock.close(linger=0)
