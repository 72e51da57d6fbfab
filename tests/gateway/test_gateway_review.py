"""Review of the gateway as clients drive it: disconnects at awkward points, and error bodies naming what the
caller sent (docs/gateway.md, "Errors" and "Disconnects")."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.routing import Route

from mii_async.gateway.sse import DONE, EventStream, event

LONG = "x " * 9000          # more tokens than the default model's context (8192) or any test KV pool holds


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_client_gone_while_sending_its_body_is_no_crash(gateway_url):
    """A client that disconnects halfway through its request body (Content-Length or chunked) is not a fault of
    the gateway: no internal_error is counted (nor logged with a traceback), and the gateway serves on."""
    routes = ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize")
    before = _metrics(gateway_url)
    for path in routes:
        for framing in (b"Content-Length: 4000\r\n\r\n{\"prompt", b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n"):
            with socket.create_connection(("127.0.0.1", _port(gateway_url))) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
                          + framing)
                time.sleep(0.2)               # the route is reading the body when the client goes
    time.sleep(0.5)
    after = _metrics(gateway_url)
    faults = {k: v - before.get(k, 0) for k, v in after.items()
              if k[0] == "mii_async_requests_total" and ("status", "internal_error") in k[1]}
    assert not any(faults.values()), faults
    r = httpx.post(f"{gateway_url}/generate", json={"prompts": "Hi", "max_new_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_max_completion_tokens_errors_name_it(gateway_url):
    """A chat request that sets max_completion_tokens (the openai package's current name) and gets it wrong is
    told about max_completion_tokens, in param and message, not about max_tokens, which it never sent."""
    msgs = [{"role": "user", "content": "Hi"}]
    for value in (0, 10 ** 7):      # refused by the gateway's check, and by the router (past the context)
        r = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=60,
                       json={"messages": msgs, "max_completion_tokens": value})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_completion_tokens", (value, err)
        assert "max_completion_tokens" in err["message"] and "max_tokens" not in \
            err["message"].replace("max_completion_tokens", ""), err
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 0}, timeout=60)
    assert r.json()["error"]["param"] == "max_tokens"


def test_generate_errors_name_the_prompts_field(gateway_url):
    """/generate's prompts are `prompts`: a prompt refused by the router is named `prompts` (one prompt) or
    `prompts[i]` (a list), and the message does not say "prompts's"."""
    cases = [({"prompts": LONG}, "prompts"), ({"prompts": ["Hi", LONG]}, "prompts[1]"),
             ({"prompts": [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": LONG}]]}, "prompts[1]"),
             ({"prompts": ["Hi", [10 ** 9]]}, "prompts[1]")]
    for body, param in cases:
        for stream in (False, True):
            r = httpx.post(f"{gateway_url}/generate", json={**body, "stream": stream, "max_new_tokens": 4}, timeout=60)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, (body, stream, err)
            assert err["message"].startswith(param + ":") and "'s'" not in err["message"] \
                and "s's " not in err["message"], err
    r = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": LONG}], "max_tokens": 4})
    err = r.json()["error"]
    assert err["param"] == "messages" and "messages's" not in err["message"], err


def test_a_fault_mid_stream_ends_the_event_stream_cleanly():
    """An event stream whose events fail half way (a fault of ours) still ends as a well-formed answer: the
    events so far, an error event in OpenAI's shape, [DONE] and the end of the chunked body (not a connection
    cut inside it, which clients report as a protocol error)."""
    async def events():
        yield event({"n": 1})
        raise RuntimeError("a rendering bug")

    async def route(_request):
        return EventStream(events())

    async def main() -> list[str]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/s", route)]), log_level="critical"))
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.get(f"http://127.0.0.1:{sock.getsockname()[1]}/s")
                return r.text.split("\n\n")
        finally:
            server.should_exit = True
            await task
            sock.close()

    parts = asyncio.run(main())
    assert parts[0] == event({"n": 1}).strip() and parts[2:] == [DONE.strip(), ""], parts
    assert '"code":"internal_error"' in parts[1] and "a rendering bug" in parts[1], parts


def test_ws_deeply_nested_frame_is_an_error_frame(gateway_url):
    """A WebSocket frame of JSON nested past the parser's depth (well within the size limit) gets an invalid_json
    error frame; the connection stays up (it was dropped without a close frame or a word)."""
    from websockets.asyncio.client import connect

    async def main() -> tuple[dict, dict]:
        async with connect(gateway_url.replace("http://", "ws://") + "/v1/ws") as ws:
            await ws.recv()                                                 # hello
            await ws.send("[" * 100_000 + "]" * 100_000)
            error = json.loads(await asyncio.wait_for(ws.recv(), 10))
            await ws.send(json.dumps({"type": "ping", "id": 7}))
            return error, json.loads(await asyncio.wait_for(ws.recv(), 10))

    error, pong = asyncio.run(main())
    assert error["type"] == "error" and error["code"] == "invalid_json" and error["id"] is None, error
    assert pong == {"type": "pong", "id": 7}
