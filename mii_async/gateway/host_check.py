"""Host and Origin checks against DNS rebinding: an ASGI middleware in front of the whole app.

A page of evil.example whose name is made to resolve to 127.0.0.1 is, to the browser, same-origin with the
gateway: it may call any route, read the answers, and open the WebSocket with `Origin: http://evil.example`.
Its requests still say `Host: evil.example`, so a Host that names none of the allowed hosts is refused (400), on
HTTP and WebSocket alike. Allowed: loopback (localhost, 127.0.0.0/8, ::1), the address the gateway is bound to,
the address a connection reached (a gateway bound to 0.0.0.0 answers on each of the machine's addresses), and
`HttpConfig.allowed_hosts`; every port. A request with no Host (HTTP/1.0 health checkers) passes: browsers
always send one. The WebSocket's Origin is checked against the same hosts (ws.py), never against the Host the
page chose.
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from ..config import host_name
from .http_errors import HTTPError, refuse_scope

LOOPBACK_NAMES = frozenset({"localhost"})


def strip_port(authority: str) -> str | None:
    """`host`, `host:port`, `[v6]`, `[v6]:port` → the host name as host_name() writes it; None if malformed."""
    if authority.startswith("["):
        end = authority.find("]")
        rest = authority[end + 1:] if end > 0 else None
        if rest is None or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return None
        return host_name(authority[:end + 1])
    name, colon, port = authority.partition(":")
    if colon and not port.isdigit():           # a bare IPv6 address, or a port that is not a number
        return None
    return host_name(name)


class AllowedHosts:
    """The host names a request may name: loopback, `bound_host`, `extra` (names, "*.suffix", or "*": any)."""

    def __init__(self, bound_host: str, extra: tuple[str, ...]) -> None:
        self.any = "*" in extra
        self.suffixes = tuple(h[1:] for h in extra if h.startswith("*."))          # ".example.com"
        self.names = LOOPBACK_NAMES | {h for h in extra if not h.startswith("*")}
        if (bound := host_name(bound_host)) is not None:
            self.names = self.names | {bound}

    def allows(self, authority: str, server: tuple | None, wildcard: bool = True) -> bool:
        """`authority`: a Host header, or an Origin's host[:port]; `server`: the ASGI scope's (address, port)
        that the connection reached. `wildcard=False` ignores "*" (an Origin must name a host)."""
        if wildcard and self.any:
            return True
        name = strip_port(authority.strip())
        if name is None:
            return False
        if name in self.names or name.endswith(self.suffixes):
            return True
        try:
            if ipaddress.ip_address(name).is_loopback:
                return True
        except ValueError:
            pass
        return bool(server) and name == host_name(str(server[0]))

    def allows_origin(self, origin: str, server: tuple | None) -> bool:
        """A browser's Origin (`https://chat.example.com:8443`) whose host is allowed; "*" does not count."""
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        return parts.scheme in ("http", "https") and self.allows(parts.netloc, server, wildcard=False)


class HostCheckMiddleware:
    def __init__(self, app, hosts: AllowedHosts) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send) -> None:
        host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), None)
        if scope["type"] not in ("http", "websocket") or host is None or self.hosts.allows(host, scope.get("server")):
            await self.app(scope, receive, send)
            return
        err = HTTPError(400, f"the Host header {host!r} names no host this gateway serves: add the name to "
                        "allowed_hosts (mii-async serve --allowed-hosts NAME)", "invalid_request_error", None,
                        "invalid_host")
        await refuse_scope(err, scope, receive, send, "Host not allowed")
