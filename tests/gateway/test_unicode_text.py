"""A lone UTF-16 surrogate ("\\ud800": legal JSON, not text) in any field is a 400 naming the field, and an
error frame on the WebSocket, which stays up; the gateway keeps serving."""
from __future__ import annotations

import asyncio
import json

import httpx
from websockets.asyncio.client import connect

LONE = "\\ud800"          # as it appears in the JSON text


def _post(url: str, path: str, body: str) -> httpx.Response:
    return httpx.post(url + path, content=body.encode(), headers={"content-type": "application/json"}, timeout=60)


def test_http_bodies_name_the_field(gateway_url, model):
    """Each route's body, any field (prompt, a stop string, model, a message, a /generate prompt, /tokenize):
    a 400 whose param is the field as sent; a UTF-16 body and an escaped pair (one character) as expected."""
    cases = [
        ("/v1/completions", f'{{"model": "{model}", "prompt": "Hi {LONE}", "max_tokens": 2}}', "prompt"),
        ("/v1/completions", f'{{"model": "{model}", "prompt": "Hi", "stop": ["a", "{LONE}"], "max_tokens": 2}}',
         "stop[1]"),
        ("/v1/completions", f'{{"model": "x{LONE}", "prompt": "Hi", "max_tokens": 2}}', "model"),
        ("/v1/chat/completions",
         f'{{"model": "{model}", "messages": [{{"role": "user", "content": "a{LONE}b"}}], "max_tokens": 2}}',
         "messages[0].content"),
        ("/generate", f'{{"prompts": ["ok", "{LONE}"], "max_new_tokens": 2}}', "prompts[1]"),
        ("/tokenize", f'{{"model": "{model}", "prompt": "{LONE}"}}', "prompt"),
    ]
    for path, body, param in cases:
        r = _post(gateway_url, path, body)
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "lone surrogate U+D800" in err["message"], (path, err)
    # a UTF-16 body (json.loads reads it; the UTF-8 pattern means nothing there) is walked too
    r = httpx.post(gateway_url + "/v1/completions", timeout=60, headers={"content-type": "application/json"},
                   content=f'{{"model": "{model}\ud800", "prompt": "x"}}'.encode("utf-16", "surrogatepass"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    # an escaped surrogate pair is one character, not an error
    r = _post(gateway_url, "/v1/completions",
              f'{{"model": "{model}", "prompt": "\\ud83d\\ude00 The capital of France is", "max_tokens": 2}}')
    assert r.status_code == 200, r.text


def test_websocket_frame_is_refused_and_the_connection_stays(gateway_url):
    """A bad id gets an error frame with id null, a bad prompt one naming prompt; the request beside them
    streams on to its end."""
    async def main():
        async with connect(gateway_url.replace("http://", "ws://") + "/v1/ws") as ws:
            await ws.recv()                                            # hello
            await ws.send('{"type": "generate", "id": "ok", "prompt": "Tell me a story.", "max_new_tokens": 24,'
                          ' "ignore_eos": true}')
            await ws.send(f'{{"type": "generate", "id": "a{LONE}", "prompt": "x"}}')
            await ws.send(f'{{"type": "generate", "id": "p", "prompt": "x{LONE}"}}')
            frames = []
            async with asyncio.timeout(120):
                while not any(f["type"] == "done" and f["id"] == "ok" for f in frames):
                    frames.append(json.loads(await ws.recv()))
            return frames

    frames = asyncio.run(main())
    errors = [f for f in frames if f["type"] == "error"]
    assert [(e["id"], e["param"]) for e in errors] == [(None, "id"), ("p", "prompt")], errors
    done = [f for f in frames if f["type"] == "done"]
    assert done[-1]["usage"]["completion_tokens"] == 24          # the request beside them was untouched
