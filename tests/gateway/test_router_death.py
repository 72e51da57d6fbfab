"""When the router dies (SIGKILL), the gateway knows at once: open SSE streams end with an error event then
[DONE], WebSocket requests get `generation_failed`, new requests and /health get 503 naming the router; a
gateway whose parent (`mii-async serve`, which runs the router) dies exits too. Real deployments of the
default model, each its own (they are killed)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from websockets.asyncio.client import connect

import mii_async
from mii_async.config import HttpConfig
from mii_async.deployment import GatewayProcess
from tests.mesh_helpers import alive, deployment_pids, until, wait_gone

pytestmark = pytest.mark.slow
LONG = {"max_tokens": 2000, "ignore_eos": True}       # runs far longer than any test waits before the kill


async def _open_sse(http: httpx.AsyncClient, path: str, body: dict) -> tuple[httpx.Response, asyncio.Queue]:
    """Starts a streamed request; its `data:` payloads arrive in the queue, then None at the body's end."""
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    lines: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        async with http.stream("POST", path, json={**body, "stream": True}) as r:
            ready.set_result(r)
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.put_nowait(line[len("data: "):])
        lines.put_nowait(None)

    task = asyncio.ensure_future(read())
    task.add_done_callback(lambda t: ready.done() or ready.set_exception(t.exception() or RuntimeError("ended")))
    return await ready, lines


async def _payloads(lines: asyncio.Queue, n: int) -> list[str]:
    """The next `n` data payloads (fewer if the body ends first)."""
    out = []
    async with asyncio.timeout(60):
        while len(out) < n and (item := await lines.get()) is not None:
            out.append(item)
    return out


async def _rest(lines: asyncio.Queue) -> list[str]:
    """Every payload up to the body's end (bounded: the stream must end once the router is gone)."""
    out = []
    async with asyncio.timeout(60):
        while (item := await lines.get()) is not None:
            out.append(item)
    return out


def _ends_with_error_then_done(payloads: list[str]) -> dict:
    assert len(payloads) >= 2 and payloads[-1] == "[DONE]", payloads[-3:]
    err = json.loads(payloads[-2])
    assert "error" in err, payloads[-3:]
    return err["error"]


def test_router_killed_under_open_sse_and_ws_streams(default_model_dir):
    """First, a gateway whose lifeline is cut (its parent gone) while the router lives: its open SSE stream
    gets an error event saying the deployment stopped, then [DONE], and it exits without draining the stream.
    Then kill -9 of the router under a gateway that outlives it: each open SSE stream (completions, chat) gets
    an error event naming the router, then [DONE]; the WebSocket request gets generation_failed; a new request
    (plain, streamed, WebSocket) and /health get 503 / `unavailable` from the closed connection (not a timeout:
    the message says the router is not answering); the gateway lives on, a client of a router that may come
    back."""
    client = mii_async.serve(str(default_model_dir), kv_cache_memory=0.1)
    router = client._process.pid
    pids = [router]
    gw = GatewayProcess(client.address, HttpConfig(http_port=0), curve_dir=client.curve_dir)
    orphan = GatewayProcess(client.address, HttpConfig(http_port=0), curve_dir=client.curve_dir)
    gateway, url = gw.pid, gw.url
    try:
        async def parent_gone() -> None:
            async with httpx.AsyncClient(base_url=orphan.url, timeout=httpx.Timeout(120.0)) as http:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                _, lines = await _open_sse(http, "/v1/completions", {"model": model, "prompt": "Once upon", **LONG})
                head = await _payloads(lines, 3)
                assert len(head) == 3 and "[DONE]" not in head, head
                orphan.child.cut_lifeline()
                err = _ends_with_error_then_done(await _rest(lines))
                assert err["code"] == "unavailable" and "the deployment stopped" in err["message"], err
            await until(lambda: _gone(orphan.pid), 30, "the gateway to exit when its lifeline ended")

        asyncio.run(parent_gone())

        async def main() -> None:
            pids.extend(deployment_pids(await client.health()))
            async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as http, \
                    connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                _, comp = await _open_sse(http, "/v1/completions", {"model": model, "prompt": "Once upon", **LONG})
                _, chat = await _open_sse(http, "/v1/chat/completions", {
                    "model": model, "messages": [{"role": "user", "content": "Tell me a story."}], **LONG})
                assert json.loads(await ws.recv())["type"] == "hello"
                await ws.send(json.dumps({"type": "generate", "id": "w", "prompt": "Once upon",
                                          "max_new_tokens": 2000, "ignore_eos": True}))
                async with asyncio.timeout(60):
                    while json.loads(await ws.recv())["type"] != "token":
                        pass
                for lines in (comp, chat):
                    head = await _payloads(lines, 3)      # streaming: chunks came, no [DONE] yet
                    assert len(head) == 3 and "[DONE]" not in head, head

                os.kill(router, signal.SIGKILL)

                for lines in (comp, chat):
                    err = _ends_with_error_then_done(await _rest(lines))
                    assert err["code"] == "unavailable" and "is not answering" in err["message"], err
                async with asyncio.timeout(60):
                    while (f := json.loads(await ws.recv()))["type"] == "token":
                        pass
                assert f["type"] == "error" and f["id"] == "w" and f["code"] == "generation_failed", f
                assert "is not answering" in f["message"], f

                r = await http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
                assert "is not answering" in r.json()["error"]["message"], r.text
                r = await http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2,
                                                             "stream": True})
                assert r.status_code == 503, r.text
                h = await http.get("/health")
                assert h.status_code == 503 and "is not answering" in h.json()["error"], h.text
                await ws.send(json.dumps({"type": "generate", "id": "x", "prompt": "hi", "max_new_tokens": 2}))
                async with asyncio.timeout(60):
                    f = json.loads(await ws.recv())
                assert f["type"] == "error" and f["id"] == "x" and f["code"] == "unavailable", f

        asyncio.run(main())
        assert alive(gateway), "the gateway exited with its router: its parent lives"
        assert not wait_gone(pids, 30.0), "the killed router's workers live on"
    finally:
        gw.stop(10.0)
        orphan.stop(10.0)
        client.close()
        client._process.stop(10.0)
    assert not wait_gone([gateway, orphan.pid, *pids]), "processes left behind"


async def _gone(pid: int) -> bool:
    return not alive(pid)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def test_gateway_exits_with_its_parent_ending_its_streams(default_model_dir):
    """kill -9 of `mii-async serve` (the router and the gateway's parent): an open SSE stream gets its error
    event then [DONE], and the gateway process exits, rather than lingering as an orphan."""
    serve = subprocess.Popen([sys.executable, "-m", "mii_async", "serve", str(default_model_dir), "--port", "0",
                              "--http-port", "0", "--kv-cache-memory", "0.1"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    gateway = None
    try:
        url = None
        while url is None:
            line = serve.stdout.readline()
            assert line, "mii-async serve exited before its gateway was up"
            if "chat page at " in line:
                url = line.split("chat page at ", 1)[1].split()[0].rstrip("/")
        [gateway] = [p for p in _children(serve.pid) if "mii_async.gateway" in _cmdline(p)]
        workers = [p for p in _children(serve.pid) if p != gateway]

        async def main() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as http:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                _, lines = await _open_sse(http, "/v1/completions", {"model": model, "prompt": "Once upon", **LONG})
                head = await _payloads(lines, 3)
                assert len(head) == 3 and "[DONE]" not in head, head
                serve.send_signal(signal.SIGKILL)
                err = _ends_with_error_then_done(await _rest(lines))
                # Whichever the gateway saw first, the closed connection or its lifeline's end; not a timeout.
                assert err["code"] == "unavailable", err
                assert "is not answering" in err["message"] or "the deployment stopped" in err["message"], err
            await until(lambda: _gone(gateway), 30, "the gateway to exit after its parent")

        asyncio.run(main())
        serve.wait(30)
        assert not wait_gone(workers, 30.0), "the router's workers live on"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(30)
        if gateway is not None and alive(gateway):
            os.kill(gateway, signal.SIGKILL)
