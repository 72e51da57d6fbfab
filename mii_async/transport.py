"""Typed async ZeroMQ sockets: business code sends and receives protocol messages, never raw zmq.

Every socket has ZMQ_MAXMSGSIZE set to the protocol's frame limit (libzmq drops a peer that sends more),
linger 0 (closing never blocks on unsent frames) and, for TCP, keepalive. A frame that does not decode is
counted in `bad_frames` and handed to the caller as a ProtocolError, so the receiver can answer it and carry on.
Concurrency: one task may receive while others send; sends are serialised by zmq.asyncio. Closing: `close()`
drops unsent frames. `SyncDealerSocket` is the blocking twin for worker processes, whose loop is not asyncio.

CURVE (mesh_keys.py says who holds which key): a RouterSocket given a keys directory is a CURVE server whose
authenticator (ZAP, `start_authenticator`) admits only the roles allowed on its domain ("clients",
"workers"), and each Received carries the sender's role. A DealerSocket presents one role's credentials: those
of `curve_dir`, or of the keys directory this user's deployment at that address published; with neither it
connects in the clear, which a deployment refuses.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import zmq
import zmq.asyncio

from . import mesh_keys, protocol
from .protocol import Message, ProtocolError

log = logging.getLogger("mii_async.transport")


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    # No high-water mark: past it libzmq drops frames to a ROUTER's peer silently (a lost final Delta is a
    # stream that never ends). What is queued is bounded by admission control instead.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def _curve_server(sock: zmq.Socket, keys_dir: str, domain: str) -> None:
    public, secret = mesh_keys.server_pair(keys_dir)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True
    sock.zap_domain = domain.encode()          # which roles the authenticator admits here (mesh_keys.ALLOWED_ROLES)


def _curve_client(sock: zmq.Socket, creds: mesh_keys.Credentials) -> None:
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = creds.server_public, creds.public, creds.secret


def start_authenticator(ctx: zmq.asyncio.Context, keys_dir: str) -> Any:
    """ZAP for the router's sockets: admits a CURVE peer whose public key is one of `keys_dir`'s roles allowed
    on that socket's domain, and stamps its messages with the role (their User-Id). Call `.stop()` when done."""
    from zmq.auth.asyncio import AsyncioAuthenticator
    from zmq.utils import z85

    roles = mesh_keys.roles_by_key(keys_dir)

    class Roles:
        def callback(self, domain: str, key: bytes) -> bool:
            role = roles.get(key)
            if role is None or role not in mesh_keys.ALLOWED_ROLES.get(domain, ()):
                log.warning("refused a CURVE peer on the %s socket (%s)", domain,
                            f"a {role}'s key" if role else "an unknown key")
                return False
            return True

    class MeshAuthenticator(AsyncioAuthenticator):
        def curve_user_id(self, client_public_key: bytes) -> str:
            return roles.get(z85.encode(client_public_key), "")

    auth = MeshAuthenticator(ctx)
    auth.start()
    for domain in mesh_keys.ALLOWED_ROLES:
        auth.configure_curve_callback(domain, Roles())
    return auth


class Received(NamedTuple):
    peer: bytes                            # the sender's routing id (ROUTER sockets), b"" otherwise
    message: Message | ProtocolError       # the message, or why its frame was refused
    role: str = ""                         # the role its CURVE key holds (mesh_keys.ROLES); "" without CURVE


class RouterSocket:
    """A bound ROUTER socket: many peers, each addressed by its routing id."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, keys_dir: str | None = None,
                 domain: str = "clients") -> None:
        """`keys_dir`: CURVE with the server's pair from it, admitting the roles of `domain` (the context
        needs `start_authenticator`); None: in the clear (a socket in a test of this module)."""
        self._sock = ctx.socket(zmq.ROUTER)
        _configure(self._sock)
        self._curve = keys_dir is not None
        if keys_dir is not None:
            _curve_server(self._sock, keys_dir, domain)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)   # a frame to a vanished peer is dropped, not an error
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bad_frames = 0

    async def recv(self) -> Received:
        if self._curve:          # Frames, for the role the authenticator stamped on them
            parts = await self._sock.recv_multipart(copy=False)
            role = parts[-1].get("User-Id") or ""
            frames = [p.bytes for p in parts]
        else:
            frames, role = await self._sock.recv_multipart(copy=True), ""
        if len(frames) != 2:
            self.bad_frames += 1
            return Received(frames[0] if frames else b"",
                            ProtocolError(f"expected 1 payload frame, got {len(frames) - 1}"), role)
        peer, data = frames
        try:
            return Received(peer, protocol.decode(data), role)
        except ProtocolError as exc:
            self.bad_frames += 1
            return Received(peer, exc, role)

    async def send(self, peer: bytes, msg: Message) -> None:
        await self._sock.send_multipart([peer, protocol.encode(msg)])

    def close(self, linger_s: float = 0.0) -> None:
        """Closes the socket; frames still queued get `linger_s` to leave."""
        self._sock.close(linger=int(linger_s * 1000))


class _Dealer:
    """What both DEALER sockets share: configuration, CURVE, identity, and decoding with a bad-frame count."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes | None, curve_dir: str | None,
                 role: str, before_connect: Any = None) -> None:
        self._sock = ctx.socket(zmq.DEALER)
        _configure(self._sock)
        self._address, self._curve_dir, self._role = address, curve_dir, role
        keys_dir = curve_dir or mesh_keys.find_keys(address)
        self.credentials = mesh_keys.credentials(keys_dir, role) if keys_dir else None
        if self.credentials is not None:
            _curve_client(self._sock, self.credentials)
        if identity is not None:
            self._sock.setsockopt(zmq.IDENTITY, identity)
        if before_connect is not None:
            before_connect()
        self._sock.connect(address)
        self.bad_frames = 0

    def refresh_credentials(self) -> bool:
        """For keys found by address (no `curve_dir` given): looks again, and where the deployment at the
        address now holds other keys (restarted, or started after this socket), reconnects with them. True
        when it did; a refused handshake is then worth another try."""
        if self._curve_dir is not None:
            return False
        keys_dir = mesh_keys.find_keys(self._address)
        creds = mesh_keys.credentials(keys_dir, self._role) if keys_dir else None
        if creds is None or creds == self.credentials:
            return False
        self._sock.disconnect(self._address)
        self.credentials = creds
        _curve_client(self._sock, creds)
        self._sock.connect(self._address)
        return True

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
    """A connecting DEALER socket: one logical peer (the router), as a client (the operator where this user
    holds the operator's key). With `monitored`, `events()` yields "up" when a connection to the router has
    completed its handshake, "down" when it closed, and "refused" when the router refused the handshake
    (credentials it does not accept; libzmq does not retry those)."""

    EVENTS = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "up", zmq.EVENT_DISCONNECTED: "down",
              zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused",
              zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused"}

    def __init__(self, ctx: zmq.asyncio.Context, address: str, identity: bytes | None = None,
                 curve_dir: str | None = None, monitored: bool = False) -> None:
        self._monitor: zmq.asyncio.Socket | None = None

        def monitor() -> None:          # before connect(): a loopback handshake is over before a later one looks
            mask = 0
            for e in self.EVENTS:
                mask |= e
            self._monitor = self._sock.get_monitor_socket(mask)

        super().__init__(ctx, address, identity, curve_dir, "client", monitor if monitored else None)

    async def events(self) -> AsyncIterator[str]:
        """The monitored connection's events, until the socket closes."""
        from zmq.utils.monitor import parse_monitor_message

        assert self._monitor is not None, "events() of a socket made without monitored=True"
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            if event in self.EVENTS:
                yield self.EVENTS[event]

    def pending(self) -> bool:
        """Whether frames already received wait to be read."""
        return bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    async def recv(self) -> Message | ProtocolError:
        return self._decode(await self._sock.recv_multipart(copy=True))

    async def send(self, msg: Message) -> None:
        await self._sock.send(protocol.encode(msg))

    def close(self, linger_s: float = 0.0) -> None:
        """Closes the monitor (before the socket: the context's term() waits for every socket), then the socket."""
        if self._monitor is not None and not self._monitor.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        super().close(linger_s)

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
        super().__init__(ctx, address, identity, curve_dir, "worker")

    def recv(self, timeout_s: float) -> Message | ProtocolError | None:
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        return self._decode(self._sock.recv_multipart(copy=True))

    def send(self, msg: Message) -> None:
        self._sock.send(protocol.encode(msg))

