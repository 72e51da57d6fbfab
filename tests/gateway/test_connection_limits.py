"""Slow and idle clients cannot hold the gateway (real gateway processes, raw sockets): a head trickled past
header_timeout_s gets 408, one over max_header_bytes 431, connections past their bounds 503 (HTTP) or 1013
(WebSocket), an idle WebSocket is closed with 1001; after each, the open-connection gauges are back at rest."""
from __future__ import annotations

import asyncio
import json
import select
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.mesh_helpers import until

WAIT_S = 30.0          # the bound on every wait here; the limits act in about a second


@pytest.fixture(scope="module")
def tight(start_gateway) -> int:
    """A gateway with short head and idle timeouts and a small head bound; its port."""
    return _port(start_gateway(header_timeout_s=1.0, max_header_bytes=8192, ws_idle_timeout_s=1.0).url)


@pytest.fixture(scope="module")
def bounded(start_gateway) -> int:
    """A gateway with small connection bounds (and a head timeout long enough to hold idle sockets); its port."""
    return _port(start_gateway(header_timeout_s=60.0, max_connections=4, max_connections_per_ip=2,
                               max_websockets=3, max_websockets_per_ip=2).url)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _open(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A TCP connection to the gateway from `source` (any 127/8 address is this host's loopback)."""
    s = socket.socket()
    s.settimeout(WAIT_S)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _head(port: int, path: str = "/v1/models", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}".encode()


def _read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """One response with a Content-Length: (status, headers, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {buf!r}"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = s.recv(65536)
        assert chunk, "closed inside a body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _closed(s: socket.socket) -> bool:
    """True when the peer closes the connection (within WAIT_S), reading and dropping anything before."""
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def _request(port: int, source: str = "127.0.0.1") -> tuple[int, dict]:
    s = _open(port, source)
    with s:
        s.sendall(_head(port, extra="Connection: close\r\n\r\n"))
        status, _, body = _read_response(s)
        return status, json.loads(body)


def _metrics(port: int) -> dict[tuple[str, tuple], float]:
    """The gateway's samples (its own scrape connection counts as one open HTTP connection)."""
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S)
    if r.status_code != 200:                # refused while the test holds this address's connections
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def _at_rest(port: int, websockets: float = 0) -> dict:
    """Waits until only the scrape's own connection is open (and `websockets` WebSockets); returns the samples."""
    async def rest():
        m = _metrics(port)
        return m if (m.get(("mii_async_http_connections", ())) == 1
                     and m.get(("mii_async_websockets", ())) == websockets) else None
    return asyncio.run(until(rest, WAIT_S, "open connections back at rest", period_s=0.2))


def _limited(m: dict, limit: str) -> float:
    return m.get(("mii_async_connections_limited_total", (("limit", limit),)), 0.0)


def _trickle_until_answer(s: socket.socket) -> bytes:
    """Sends a header line whenever nothing arrived for 0.2 s (a slowloris client), until the gateway answers."""
    deadline = time.monotonic() + WAIT_S
    i = 0
    while time.monotonic() < deadline:
        if select.select([s], [], [], 0.2)[0]:
            return s.recv(65536)
        try:
            s.sendall(b"X-Slow-%d: 1\r\n" % i)
        except (BrokenPipeError, ConnectionResetError):
            return s.recv(65536)
        i += 1
    raise AssertionError("no answer while the headers trickled")


def test_trickled_headers_get_408_and_a_silent_connection_is_closed(tight):
    """A head still trickling past header_timeout_s gets 408 naming the limit, on a fresh connection and on a
    kept-alive one after a first request; a connection that sends nothing is closed without an answer; no
    connection stays counted."""
    before = _metrics(tight)
    s = _open(tight)
    with s:
        s.sendall(_head(tight))
        answer = _trickle_until_answer(s)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout" and "header_timeout_s" in body["error"]["message"]
        assert b"connection: close" in answer.lower() and _closed(s)
    s = _open(tight)
    with s:
        s.sendall(_head(tight, extra="\r\n"))
        assert _read_response(s)[0] == 200        # a whole head in time is served, and the connection kept
        s.sendall(_head(tight))
        assert _trickle_until_answer(s).startswith(b"HTTP/1.1 408 ")
    s = _open(tight)
    with s:
        assert s.recv(65536) == b""              # nothing sent, nothing answered: closed
    after = _at_rest(tight)
    assert _limited(after, "header_timeout_s") - _limited(before, "header_timeout_s") == 3


def test_oversized_head_gets_431_and_a_large_body_is_not_a_head(tight):
    """A head over max_header_bytes gets 431 naming the limit before its end arrives; a head under it is served,
    and so is a small head whose body comes in the same write and takes it past the bound."""
    before = _metrics(tight)
    s = _open(tight)
    with s:
        s.sendall(_head(tight) + b"X-Big: ")
        answer = b""
        try:
            for _ in range(64):                 # 64 KiB of one header value, never ended
                s.sendall(b"a" * 1024)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "headers_too_large" and "max_header_bytes" in body["error"]["message"]
    s = _open(tight)
    with s:
        s.sendall(_head(tight, extra="X-Fits: " + "a" * 6000 + "\r\nConnection: close\r\n\r\n"))
        assert _read_response(s)[0] == 200
    payload = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode() + b" " * 20000   # JSON, 20 KB > 8 KiB
    s = _open(tight)
    with s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (tight, len(payload), payload))
        status, _, body = _read_response(s)
        assert status == 200, body
    after = _at_rest(tight)
    assert _limited(after, "max_header_bytes") - _limited(before, "max_header_bytes") == 1


def test_connection_bounds_per_ip_and_in_total(bounded):
    """Past max_connections_per_ip a client's new connection gets 503 naming the bound while another address
    is served; past max_connections every address gets 503; once the held connections close, all are served
    and the gauge is back at rest."""
    _at_rest(bounded)
    held = [_open(bounded), _open(bounded)]                  # 127.0.0.1 at its bound of 2
    try:
        status, body = _request(bounded)
        assert status == 503 and "max_connections_per_ip" in body["error"]["message"], body
        assert body["error"]["code"] == "too_many_connections"
        assert _request(bounded, "127.0.0.2")[0] == 200      # another client is served
        held += [_open(bounded, "127.0.0.2"), _open(bounded, "127.0.0.2")]   # 4 open: the total bound
        status, body = _request(bounded, "127.0.0.3")
        assert status == 503 and "(max_connections)" in body["error"]["message"], body
    finally:
        for s in held:
            s.close()
    m = _at_rest(bounded)
    assert _limited(m, "max_connections_per_ip") >= 1 and _limited(m, "max_connections") >= 1
    assert _request(bounded)[0] == 200 and _request(bounded, "127.0.0.3")[0] == 200


async def _ws_open(port: int, source: str = "127.0.0.1"):
    """A WebSocket from `source`, its hello frame read; the caller closes it (`ws.close()`)."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return await connect(f"ws://127.0.0.1:{port}/v1/ws", sock=sock, open_timeout=WAIT_S)


async def _refused_code(port: int, source: str = "127.0.0.1") -> tuple[int, str]:
    ws = await _ws_open(port, source)
    try:
        async with asyncio.timeout(WAIT_S):
            await ws.recv()
    except ConnectionClosed as exc:
        return exc.rcvd.code, exc.rcvd.reason
    finally:
        await ws.close()
    raise AssertionError("a WebSocket past its bound was not closed")


def test_websocket_bounds_close_with_1013(bounded):
    """Past max_websockets_per_ip a client's new WebSocket is accepted then closed with 1013 and a reason naming
    the bound, while another address gets in; past max_websockets every address gets 1013; afterwards new
    WebSockets open and the gauge is back at 0."""
    _at_rest(bounded)

    async def main():
        open_ = [await _ws_open(bounded), await _ws_open(bounded)]
        try:
            for ws in open_:
                assert json.loads(await ws.recv())["type"] == "hello"
            code, reason = await _refused_code(bounded)
            assert code == 1013 and "max_websockets_per_ip" in reason, (code, reason)
            open_.append(await _ws_open(bounded, "127.0.0.2"))
            assert json.loads(await open_[-1].recv())["type"] == "hello"
            assert _metrics(bounded)[("mii_async_websockets", ())] == 3
            code, reason = await _refused_code(bounded, "127.0.0.3")
            assert code == 1013 and "max_websockets)" in reason, (code, reason)
        finally:
            for ws in open_:
                await ws.close()

    asyncio.run(main())
    m = _at_rest(bounded)
    assert _limited(m, "max_websockets_per_ip") >= 1 and _limited(m, "max_websockets") >= 1

    async def again():
        ws = await _ws_open(bounded, "127.0.0.3")
        try:
            assert json.loads(await ws.recv())["type"] == "hello"
        finally:
            await ws.close()

    asyncio.run(again())


def test_idle_websocket_is_closed_with_1001_but_not_while_a_request_runs(tight):
    """With ws_idle_timeout_s = 1, a WebSocket whose request streams (256 tokens: seconds on a CPU) stays open
    until the request is done, then is closed with 1001 and a reason naming the limit."""
    before = _metrics(tight)

    async def main():
        ws = await _ws_open(tight)
        try:
            assert json.loads(await ws.recv())["type"] == "hello"
            await ws.send(json.dumps({"type": "generate", "id": "long", "prompt": "Once upon a time",
                                      "max_new_tokens": 256, "ignore_eos": True}))
            frames, closed = [], None
            try:
                async with asyncio.timeout(120):
                    while True:
                        frames.append((time.monotonic(), json.loads(await ws.recv())))
            except ConnectionClosed as exc:
                closed = exc
            return frames, closed
        finally:
            await ws.close()

    frames, closed = asyncio.run(main())
    assert frames and frames[-1][1]["type"] == "done", frames[-3:]
    assert sum(len(f.get("token_ids", ())) for _, f in frames) == 256
    assert closed is not None and closed.rcvd is not None and closed.rcvd.code == 1001, closed
    assert "ws_idle_timeout_s" in closed.rcvd.reason
    after = _at_rest(tight)
    assert _limited(after, "ws_idle_timeout_s") - _limited(before, "ws_idle_timeout_s") == 1


def test_protocol_pings_do_not_keep_a_websocket_open(tight):
    """A WebSocket whose client sends only protocol pings (answered below the app) is closed as idle (1001)."""
    async def main():
        ws = await _ws_open(tight)
        try:
            assert json.loads(await ws.recv())["type"] == "hello"
            async with asyncio.timeout(WAIT_S):
                while True:
                    await asyncio.sleep(0.2)
                    await ws.ping()
        except ConnectionClosed as exc:
            return exc
        finally:
            await ws.close()

    closed = asyncio.run(main())
    assert closed.rcvd is not None and closed.rcvd.code == 1001 and "ws_idle_timeout_s" in closed.rcvd.reason
    _at_rest(tight)


def test_limits_are_validated_and_set_from_the_command_line():
    """Each limit refuses a bad value naming its field; the `gateway` flags reach HttpConfig, unset ones keep
    its defaults."""
    import argparse

    from mii_async import cli_http
    from mii_async.config import HttpConfig
    from mii_async.errors import InvalidParameterError

    for field, bad in (("header_timeout_s", 0), ("header_timeout_s", float("inf")), ("ws_idle_timeout_s", "300"),
                       ("max_header_bytes", 0), ("max_connections", True), ("max_connections_per_ip", -1),
                       ("max_websockets", 1.5), ("max_websockets_per_ip", None)):
        with pytest.raises(InvalidParameterError) as err:
            HttpConfig(**{field: bad})
        assert err.value.param == field
    p = argparse.ArgumentParser()
    cli_http.add_http_args(p)
    cfg = json.loads(cli_http.gateway_config(p.parse_args(["--header-timeout", "2.5", "--max-connections-per-ip", "7",
                                                       "--ws-idle-timeout", "60"])))
    http = HttpConfig(**cfg)
    assert (http.header_timeout_s, http.max_connections_per_ip, http.ws_idle_timeout_s) == (2.5, 7, 60.0)
    assert (http.max_connections, http.max_websockets) == (HttpConfig.max_connections, HttpConfig.max_websockets)
    with pytest.raises(InvalidParameterError) as err:
        cli_http.gateway_config(p.parse_args(["--max-websockets", "0"]))
    assert err.value.param == "max_websockets"
