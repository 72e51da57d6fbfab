"""Host and Origin checks against DNS rebinding, on real gateway processes: a Host naming no allowed host is
refused on HTTP and on the WebSocket; the WebSocket's Origin must name an allowed host, whatever Host says."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from mii_async.config import HttpConfig
from mii_async.errors import InvalidParameterError
from mii_async.gateway.host_check import AllowedHosts


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _get(url: str, host: str) -> httpx.Response:
    return httpx.get(url + "/v1/models", headers={"Host": host}, timeout=30)


def _ws_opens(url: str, host: str, origin: str | None) -> int:
    """Opens /v1/ws at `url`'s socket with `host` as the Host: 101 when the hello frame comes, else the status."""
    async def main() -> int:
        sock = socket.create_connection(("127.0.0.1", _port(url)), timeout=30)
        try:
            async with connect(f"ws://{host}/v1/ws", sock=sock, origin=origin, proxy=None, open_timeout=30) as ws:
                assert json.loads(await ws.recv())["type"] == "hello"
                return 101
        except InvalidStatus as exc:
            return exc.response.status_code

    return asyncio.run(main())


def test_forged_host_is_refused_on_http(gateway_url):
    """A Host that is not loopback nor the bound address gets 400 in OpenAI's shape; loopback names pass."""
    port = _port(gateway_url)
    r = _get(gateway_url, "evil.example")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_host" and "evil.example" in err["message"] and "allowed_hosts" in err["message"]
    assert _get(gateway_url, f"evil.example:{port}").status_code == 400
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "127.0.0.1"):
        assert _get(gateway_url, host).status_code == 200, host


def test_forged_host_and_origin_are_refused_on_the_websocket(gateway_url):
    """A rebound page (Origin and Host both evil.example) cannot open the WebSocket; nor can a foreign Origin
    with the right Host; loopback Origins and tools without an Origin can."""
    port = _port(gateway_url)
    assert _ws_opens(gateway_url, f"evil.example:{port}", f"http://evil.example:{port}") == 400
    assert _ws_opens(gateway_url, f"evil.example:{port}", None) == 400
    assert _ws_opens(gateway_url, f"127.0.0.1:{port}", "http://evil.example") == 403
    assert _ws_opens(gateway_url, f"127.0.0.1:{port}", f"http://127.0.0.1:{port}") == 101
    assert _ws_opens(gateway_url, f"127.0.0.1:{port}", "http://localhost:3000") == 101
    assert _ws_opens(gateway_url, f"localhost:{port}", None) == 101


def test_configured_names_are_accepted(start_gateway):
    """allowed_hosts names (and *.suffix) pass as Host and as the WebSocket's Origin; others stay refused; "*"
    lets any Host through but no foreign Origin."""
    named = start_gateway(allowed_hosts=["chat.example.com", "*.corp.example"])
    assert _get(named.url, "chat.example.com").status_code == 200
    assert _get(named.url, "CHAT.example.com:8443").status_code == 200
    assert _get(named.url, "a.corp.example").status_code == 200
    assert _get(named.url, "corp.example").status_code == 400
    assert _get(named.url, "other.example").status_code == 400
    assert _ws_opens(named.url, "chat.example.com", "https://chat.example.com") == 101
    assert _ws_opens(named.url, "chat.example.com", "https://other.example") == 403
    anyhost = start_gateway(allowed_hosts=["*"])
    assert _get(anyhost.url, "evil.example").status_code == 200
    assert _ws_opens(anyhost.url, "evil.example", "http://evil.example") == 403
    assert _ws_opens(anyhost.url, "evil.example", None) == 101


def test_allowed_hosts_rules():
    """Ports, IPv6 brackets, case and a trailing dot do not matter; a malformed Host is refused; the address a
    connection reached is allowed (a gateway on 0.0.0.0); a bad allowed_hosts entry is refused naming it."""
    hosts = AllowedHosts("0.0.0.0", HttpConfig(allowed_hosts=["Chat.Example.com."]).allowed_hosts)
    server = ("10.1.2.3", 8000)
    assert [hosts.allows(h, server) for h in ("chat.example.com:80", "[::1]:8000", "127.0.0.2", "10.1.2.3:8000",
                                             "localhost.")] == [True] * 5
    assert [hosts.allows(h, server) for h in ("10.1.2.4", "::1", "[::1", "localhost:x", "", "evil.example",
                                             "chat.example.com.evil.example")] == [False] * 7
    assert hosts.allows_origin("http://10.1.2.3:8000", server) and not hosts.allows_origin("null", server)
    assert not hosts.allows_origin("ftp://localhost", server)
    for bad in ("http://a.example", "a.example:80", "a b", "", "*.", 5):
        with pytest.raises(InvalidParameterError) as exc:
            HttpConfig(allowed_hosts=[bad])
        assert exc.value.param == "allowed_hosts"


def test_cli_allowed_hosts_flag(deployment, tmp_path):
    """`mii-async gateway --allowed-hosts a,b --allowed-hosts c` serves those names; a bad one exits 2 naming
    allowed_hosts."""
    bad = subprocess.run([sys.executable, "-m", "mii_async", "gateway", "--router", deployment.address,
                          "--allowed-hosts", "http://chat.example.com"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "allowed_hosts" in bad.stderr, bad.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "gateway.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mii_async", "gateway", "--router", deployment.address,
                                 "--http-port", str(port), "--allowed-hosts", "a.example, chat.example.com",
                                 "--allowed-hosts", "c.example"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()
            time.sleep(0.2)
        assert [_get(url, h).status_code for h in ("chat.example.com", "c.example", "a.example", "b.example")] == \
            [200, 200, 200, 400]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
