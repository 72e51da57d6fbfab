"""Typed async ZeroMQ sockets: business code sends and receives protocol messages, never raw zmq.

Every socket has ZMQ_MAXMSGSIZE set to the protocol's frame limit (libzmq drops a peer that sends more),
linger 0 (closing never blocks on unsent frames) and, for TCP, keepalive. A frame that does not decode is
counted in `bad_frames` and handed to the caller as a ProtocolError, so the receiver can answer it and carry on.
Concurrency: one task may receive while others send; sends are serialised by zmq.asyncio. Closing: `close()`
drops unsent frames. `SyncDealerSocket` is the blocking twin for worker processes, whose loop is not asyncio.

CURVE (`curve_dir`, made by `mii-async keys DIR`): a RouterSocket is a CURVE server with DIR/server.key_secret
and accepts only the public keys in DIR/authorized/ (through `start_authenticator`); a DealerSocket is a client
with DIR/client.key_secret that trusts DIR/server.key. Both sides then encrypt and authenticate every frame.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import zmq
import zmq.asyncio

from . import protocol
from .protocol import Message, ProtocolError


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    # No high-water mark: past it libzmq drops frames to a ROUTER's peer silently (a lost final Delta is a
    # stream that never ends). What is queued is bounded by admission control instead.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def _curve_file(curve_dir: str, name: str) -> str:
    path = os.path.join(curve_dir, name)
    if not os.path.isfile(path):
        from .errors import InvalidParameterError

        raise InvalidParameterError("curve_dir", f"{path} is missing; make the keys with `mii-async keys {curve_dir}`")
    return path


def _curve_server(sock: zmq.Socket, curve_dir: str) -> None:
    import zmq.auth

    public, secret = zmq.auth.load_certificate(_curve_file(curve_dir, "server.key_secret"))
    sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True


def _curve_client(sock: zmq.Socket, curve_dir: str) -> None:
    import zmq.auth

    server_public, _ = zmq.auth.load_certificate(_curve_file(curve_dir, "server.key"))
    public, secret = zmq.auth.load_certificate(_curve_file(curve_dir, "client.key_secret"))
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret


def make_curve_keys(curve_dir: str, force: bool = False) -> None:
    """Writes a server and a client key pair into `curve_dir` and authorizes the client's public key. Keys
    already there are kept (InvalidParameterError naming `dir`) unless `force`: new ones would lock out every
    worker and client that holds the old."""
    import shutil

    import zmq.auth

    from .errors import InvalidParameterError

    there = [n for n in ("server.key", "server.key_secret", "client.key", "client.key_secret")
             if os.path.exists(os.path.join(curve_dir, n))]
    if there and not force:
        raise InvalidParameterError("dir", f"{curve_dir} already holds keys ({', '.join(there)}); new ones would "
                                    "lock out the workers and clients that use them (--force replaces them)")
    os.makedirs(os.path.join(curve_dir, "authorized"), exist_ok=True)
    zmq.auth.create_certificates(curve_dir, "server")
    zmq.auth.create_certificates(curve_dir, "client")
    shutil.copy(os.path.join(curve_dir, "client.key"), os.path.join(curve_dir, "authorized", "client.key"))
    for name in ("server.key_secret", "client.key_secret"):
        os.chmod(os.path.join(curve_dir, name), 0o600)


def start_authenticator(ctx: zmq.asyncio.Context, curve_dir: str) -> Any:
    """Accepts CURVE clients whose public key is in `curve_dir`/authorized; call `.stop()` when done."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=os.path.join(curve_dir, "authorized"))
    return auth


class Received(NamedTuple):
    peer: bytes                            # the sender's routing id (ROUTER sockets), b"" otherwise
    message: Message | ProtocolError       # the message, or why its frame was refused


class RouterSocket:
    """A bound ROUTER socket: many peers, each addressed by its routing id."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, curve_dir: str | None = None) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        _configure(self._sock)
        if curve_dir:
            _curve_server(self._sock, curve_dir)
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

    def close(self, linger_s: float = 0.0) -> None:
        """Closes the socket; frames still queued get `linger_s` to leave."""
        self._sock.close(linger=int(linger_s * 1000))


class _Dealer:
    """What both DEALER sockets share: configuration, CURVE, identity, and decoding with a bad-frame count."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes | None, curve_dir: str | None) -> None:
        self._sock = ctx.socket(zmq.DEALER)
        _configure(self._sock)
        if curve_dir:
            _curve_client(self._sock, curve_dir)
        if identity is not None:
            self._sock.setsockopt(zmq.IDENTITY, identity)
        self._sock.connect(address)
        self.bad_frames = 0

    def _decode(self, frames: list[bytes]) -> Message | ProtocolError:
        if len(frames) != 1:
            self.bad_frames += 1
            return ProtocolError(f"expected 1 frame, got {len(frames)}")
        try:
            return protocol.decode(frames[0])
        except ProtocolError as exc:
            self.bad_frames += 1
            return exc

    def close(self, linger_s: float = 0.0) -> None:
        """Closes the socket; frames still queued get `linger_s` to leave (the context's term() waits that long)."""
        self._sock.close(linger=int(linger_s * 1000))


class DealerSocket(_Dealer):
    """A connecting DEALER socket: one logical peer (the router)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, identity: bytes | None = None,
                 curve_dir: str | None = None) -> None:
        super().__init__(ctx, address, identity, curve_dir)

    async def recv(self) -> Message | ProtocolError:
        return self._decode(await self._sock.recv_multipart(copy=True))

    async def send(self, msg: Message) -> None:
        await self._sock.send(protocol.encode(msg))

    def send_nowait(self, msg: Message) -> bool:
        """Queues a frame without awaiting (from the socket's own loop thread, in code that must not await: a
        close); False when libzmq would not take it now."""
        try:
            zmq.Socket.send(self._sock, protocol.encode(msg), zmq.DONTWAIT)   # the blocking class's send
        except zmq.ZMQError:
            return False
        return True


class SyncDealerSocket(_Dealer):
    """A blocking DEALER socket for a worker process: `recv(timeout)` returns None when nothing came."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes, curve_dir: str | None = None) -> None:
        super().__init__(ctx, address, identity, curve_dir)

    def recv(self, timeout_s: float) -> Message | ProtocolError | None:
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        return self._decode(self._sock.recv_multipart(copy=True))

    def send(self, msg: Message) -> None:
        self._sock.send(protocol.encode(msg))

