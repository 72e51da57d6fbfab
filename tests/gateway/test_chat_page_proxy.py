"""The chat page behind a reverse proxy that serves the gateway under a path prefix (nginx's
`location /mii/ { proxy_pass http://gateway/; }`), in headless chromium: every request of the page, its WebSocket
included, must stay under the prefix, or the proxy never sees it."""
from __future__ import annotations

import asyncio
import socket
import threading
from urllib.parse import urlsplit

import pytest

from tests.gateway.test_chat_page import MISSING, REQUIRE, browser, new_chat  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None and not REQUIRE, reason=f"no browser: {MISSING}")]
PREFIX = "/mii/"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "host", "content-length"}


def prefix_proxy(upstream: str):
    """An ASGI app: PREFIX/x → upstream/x (HTTP and WebSocket); anything outside PREFIX is a 404, as at a proxy
    that serves other sites beside this one."""
    import httpx
    from websockets.asyncio.client import connect

    up = urlsplit(upstream)

    async def app(scope, receive, send):
        path = scope["path"]
        target = "/" + path[len(PREFIX):] if path.startswith(PREFIX) else None
        query = scope["query_string"].decode()
        target = target and target + (f"?{query}" if query else "")
        if scope["type"] == "websocket":
            await receive()                                          # websocket.connect
            if target is None:
                await send({"type": "websocket.close", "code": 1008})
                return
            async with connect(f"ws://{up.netloc}{target}") as server:
                await send({"type": "websocket.accept"})

                async def to_server():
                    while (m := await receive())["type"] == "websocket.receive":
                        await server.send(m["text"] if m.get("text") is not None else m["bytes"])
                    await server.close()

                async def to_browser():
                    async for m in server:
                        await send({"type": "websocket.send", **({"text": m} if isinstance(m, str) else {"bytes": m})})
                    await send({"type": "websocket.close", "code": 1012})

                tasks = [asyncio.ensure_future(to_server()), asyncio.ensure_future(to_browser())]
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in tasks:
                    t.cancel()
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if target is None:
            status, headers, content = 404, [], b"not under the proxy's prefix"
        else:
            fwd = [(k, v) for k, v in scope["headers"] if k.decode().lower() not in HOP_BY_HOP]
            async with httpx.AsyncClient(base_url=upstream) as http:
                r = await http.request(scope["method"], target, headers=fwd, content=body)
            status, content = r.status_code, r.content
            headers = [(k.encode(), v.encode()) for k, v in r.headers.items() if k.lower() not in HOP_BY_HOP]
        await send({"type": "http.response.start", "status": status,
                    "headers": headers + [(b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})

    return app


@pytest.fixture
def proxy_url(gateway_url):
    """http://127.0.0.1:PORT/mii/ in front of the session's gateway (uvicorn in a thread of this process)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(prefix_proxy(gateway_url), ws="websockets-sansio", lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}{PREFIX}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_works_under_a_path_prefix(new_chat, proxy_url):
    """Opened at http://proxy/mii/, the page loads its CSS and JS and opens its WebSocket under /mii/, connects
    and streams an answer; nothing goes outside the prefix and nothing is logged as an error."""
    chat = new_chat(proxy_url.rstrip("/"))
    chat.open()
    chat.settings(max_tokens="4")
    chat.ask("Hello!")
    assert chat.answer(0)[0] in ("stop", "length")
    assert {f"{proxy_url}static/chat.css", f"{proxy_url}static/chat.js"} <= set(chat.requests)
    assert chat.sockets == [f"ws://{urlsplit(proxy_url).netloc}{PREFIX}v1/ws"]
    assert [u for u in chat.requests if not u.startswith((proxy_url, "data:"))] == []
    assert chat.console_errors == []
