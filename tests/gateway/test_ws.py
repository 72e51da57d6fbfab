"""The gateway's WebSocket (/v1/ws) against the real deployment of the default model."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.mesh_helpers import kv_idle, until

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _ws(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/ws"


async def _frames_until(ws, pred, timeout_s: float = 60.0) -> list[dict]:
    """Reads frames until one satisfies `pred`; returns them all (that one last)."""
    out = []
    async with asyncio.timeout(timeout_s):
        while True:
            f = json.loads(await ws.recv())
            out.append(f)
            if pred(f):
                return out


def test_concurrent_streams_on_one_connection(gateway_url, deployment):
    """Several requests on one socket stream interleaved tokens; each one's text equals what the client API
    gives for the same request, and each ends with a done frame carrying usage."""
    prompts = {f"r{i}": f"Count from {i} to {i + 5}:" for i in range(4)}

    async def main():
        async with connect(_ws(gateway_url)) as ws:
            hello = json.loads(await ws.recv())
            assert hello["type"] == "hello" and hello["model"] == (await deployment.health())["model_name"]
            await ws.send(json.dumps({"type": "generate", "id": "chat", "messages": QUESTION, "max_new_tokens": 12}))
            for rid, p in prompts.items():
                await ws.send(json.dumps({"type": "generate", "id": rid, "prompt": p, "max_new_tokens": 10}))
            text = {rid: "" for rid in [*prompts, "chat"]}
            done: dict[str, dict] = {}
            order = []
            async with asyncio.timeout(60):
                while len(done) < len(text):
                    f = json.loads(await ws.recv())
                    if f["type"] == "token":
                        text[f["id"]] += f["text"]
                        order.append(f["id"])
                    elif f["type"] == "done":
                        done[f["id"]] = f
                    else:
                        raise AssertionError(f)
        expected = {rid: (await deployment.generate(p, max_new_tokens=10))[0].generated_text for rid, p in prompts.items()}
        return text, done, order, expected

    text, done, order, expected = asyncio.run(main())
    assert "Paris" in text["chat"] and done["chat"]["finish_reason"] == "stop"
    for rid in prompts:
        assert text[rid] == expected[rid]
        assert done[rid]["finish_reason"] == "length" and done[rid]["usage"]["completion_tokens"] == 10
    assert len(set(order[:10])) > 1, "streams were not interleaved"


def test_cancel_and_bad_frames_keep_the_connection(gateway_url, deployment):
    """cancel ends a request with finish_reason abort and frees its KV; malformed JSON, an unknown type, a
    duplicate id and a bad parameter each get an error frame (naming the parameter) and the socket stays up."""
    async def main():
        async with connect(_ws(gateway_url)) as ws:
            await ws.recv()                                            # hello
            await ws.send(json.dumps({"type": "generate", "id": 7, "prompt": "Tell me a long story.",
                                      "max_new_tokens": 400, "ignore_eos": True}))
            await _frames_until(ws, lambda f: f["type"] == "token")
            await ws.send(json.dumps({"type": "generate", "id": 7, "prompt": "again"}))
            dup = await _frames_until(ws, lambda f: f["type"] == "error")
            await ws.send("{not json")
            bad_json = await _frames_until(ws, lambda f: f["type"] == "error")
            await ws.send(json.dumps({"type": "fly", "id": 1}))
            unknown = await _frames_until(ws, lambda f: f["type"] == "error")
            await ws.send(json.dumps({"type": "generate", "id": "t", "prompt": "x", "temperature": -1}))
            bad_param = await _frames_until(ws, lambda f: f["type"] == "error")
            await ws.send(json.dumps({"type": "generate", "id": "u", "prompt": "x", "max_new_tokenz": 3}))
            unknown_param = await _frames_until(ws, lambda f: f["type"] == "error")
            await ws.send(json.dumps({"type": "cancel", "id": 7}))
            cancelled = await _frames_until(ws, lambda f: f["type"] == "done" and f["id"] == 7)
            await kv_idle(deployment)
            await ws.send(json.dumps({"type": "ping"}))
            pong = await _frames_until(ws, lambda f: f["type"] == "pong")
            await ws.send(json.dumps({"type": "generate", "id": "after", "messages": QUESTION, "max_new_tokens": 12}))
            after = await _frames_until(ws, lambda f: f["type"] == "done")
        return dup, bad_json, unknown, bad_param, unknown_param, cancelled, pong, after

    dup, bad_json, unknown, bad_param, unknown_param, cancelled, pong, after = asyncio.run(main())
    assert dup[-1]["id"] == 7 and dup[-1]["param"] == "id" and "already running" in dup[-1]["message"]
    assert bad_json[-1]["code"] == "invalid_json" and bad_json[-1]["id"] is None
    assert unknown[-1]["code"] == "invalid_message" and unknown[-1]["param"] == "type"
    assert bad_param[-1]["id"] == "t" and bad_param[-1]["param"] == "temperature"
    assert unknown_param[-1]["param"] == "max_new_tokenz"
    assert cancelled[-1]["finish_reason"] == "abort"
    assert pong[-1]["type"] == "pong"
    assert "Paris" in "".join(f.get("text", "") for f in after) and after[-1]["finish_reason"] == "stop"


def test_refused_request_is_an_error_frame(gateway_url):
    """A request that can never fit is refused with an error frame naming max_new_tokens."""
    async def main():
        async with connect(_ws(gateway_url)) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "generate", "id": "big", "prompt": "x", "max_new_tokens": 10 ** 6}))
            return await _frames_until(ws, lambda f: f["type"] in ("error", "done"))

    err = asyncio.run(main())[-1]
    assert err["type"] == "error" and err["code"] == "request_too_long" and err["param"] == "max_new_tokens"


def test_cancel_at_once_and_out_of_range_values(gateway_url, deployment):
    """A cancel sent right behind its generate still answers abort and frees the id for reuse; token ids and
    integers that do not fit the wire (uint32, counts) are error frames naming the parameter, not a silence."""
    async def main():
        async with connect(_ws(gateway_url)) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "generate", "id": "q", "prompt": "Hello", "max_new_tokens": 200,
                                      "ignore_eos": True}))
            await ws.send(json.dumps({"type": "cancel", "id": "q"}))
            first = await _frames_until(ws, lambda f: f["type"] in ("done", "error") and f["id"] == "q")
            await ws.send(json.dumps({"type": "generate", "id": "q", "prompt": "Hello", "max_new_tokens": 3,
                                      "ignore_eos": True}))
            again = await _frames_until(ws, lambda f: f["type"] in ("done", "error") and f["id"] == "q")
            await ws.send(json.dumps({"type": "generate", "id": "ids", "prompt": [1, 2 ** 40]}))
            ids = await _frames_until(ws, lambda f: f["type"] in ("done", "error"))
            await ws.send(json.dumps({"type": "generate", "id": "k", "prompt": "x", "top_k": 10 ** 30}))
            top_k = await _frames_until(ws, lambda f: f["type"] in ("done", "error"))
            await kv_idle(deployment)
        return first[-1], again[-1], ids[-1], top_k[-1]

    first, again, ids, top_k = asyncio.run(main())
    assert first["type"] == "done" and first["finish_reason"] == "abort", first
    assert again["type"] == "done" and again["finish_reason"] == "length", again
    assert ids["type"] == "error" and ids["param"] == "prompt" and "out of range" in ids["message"], ids
    assert top_k["type"] == "error" and top_k["param"] == "top_k", top_k


def test_foreign_origin_is_refused(gateway_url, start_gateway):
    """A browser page of another site cannot open the WebSocket (403 at the handshake); a loopback page (the
    gateway's own or another port's), a listed origin and tools that send no Origin can."""
    port = gateway_url.rsplit(":", 1)[1]
    listed = start_gateway(allowed_origins=["https://app.example.com"])

    async def opens(url: str, origin: str | None) -> bool:
        try:
            async with connect(_ws(url), origin=origin) as ws:
                return json.loads(await ws.recv())["type"] == "hello"
        except InvalidStatus as exc:
            assert exc.response.status_code == 403
            return False

    async def main():
        return [await opens(gateway_url, None), await opens(gateway_url, f"http://127.0.0.1:{port}"),
                await opens(gateway_url, "http://evil.example"), await opens(gateway_url, f"http://localhost:{port}"),
                await opens(listed.url, "https://app.example.com"), await opens(listed.url, "https://other.example")]

    assert asyncio.run(main()) == [True, True, False, True, True, False]


def test_disconnect_cancels_every_request(gateway_url, deployment):
    """Closing the socket with three requests streaming aborts them all: KV blocks return to the baseline."""
    async def main():
        await kv_idle(deployment)
        ws = await connect(_ws(gateway_url))
        await ws.recv()
        for i in range(3):
            await ws.send(json.dumps({"type": "generate", "id": i, "prompt": f"Story {i}:", "max_new_tokens": 500,
                                      "ignore_eos": True}))
        await _frames_until(ws, lambda f: f["type"] == "token")
        await until(lambda: _running(deployment, 3), 20, "three running requests")
        await ws.close()
        await kv_idle(deployment, timeout_s=10)

    asyncio.run(main())


async def _running(client, n: int) -> bool:
    s = await client.stats()          # the replica busy past the stats deadline is unanswered: poll again
    return not s["unanswered"] and s["running"] == n


def test_oversize_frame_closes_with_1009(gateway_url):
    """A frame over ws_max_message_bytes (1 MiB) closes the socket with 1009 (message too big)."""
    async def main():
        async with connect(_ws(gateway_url), max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "generate", "id": 1, "prompt": "x" * (2 << 20)}))
            with pytest.raises(ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 10)
            return info.value

    closed = asyncio.run(main())
    assert closed.rcvd is not None and closed.rcvd.code == 1009


@pytest.mark.parametrize("bound", [{"ws_send_queue": 16}, {"ws_send_queue_bytes": 16384}], ids=["frames", "bytes"])
def test_slow_reader_is_closed_not_buffered(start_gateway, deployment, bound):
    """A client that asks for much and reads nothing fills its bounded send queue (16 frames, or 16 KiB of
    them); the gateway closes the socket (1013) instead of growing, and the requests are aborted (KV back at
    the baseline)."""
    gw = start_gateway(**bound)

    async def main():
        await kv_idle(deployment)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # a small window: backpressure comes soon
        sock.connect(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
        ws = await connect(_ws(gw.url), sock=sock, max_queue=1)
        for i in range(32):
            await ws.send(json.dumps({"type": "generate", "id": i, "prompt": f"Story {i}:", "max_new_tokens": 48,
                                      "ignore_eos": True, "logprobs": 20}))
        await until(lambda: _idle_or_gone(deployment), 90, "the slow reader's requests to be aborted", 0.5)
        codes = []
        try:
            async with asyncio.timeout(30):
                while True:
                    await ws.recv()
        except ConnectionClosed as exc:
            codes.append(exc.rcvd.code if exc.rcvd else 1006)
        await kv_idle(deployment)
        return codes

    codes = asyncio.run(main())
    assert codes and codes[0] in (1013, 1006), codes


async def _idle_or_gone(client) -> bool:
    s = await client.stats()
    return not s["unanswered"] and s["running"] == 0 and s["waiting"] == 0 and s["used_blocks"] == 0


def test_prompt_logprobs_on_the_first_token_frame(gateway_url, deployment):
    """prompt_logprobs asked in a generate frame come on its first token frame only, one per prompt token
    ({token_id, logprob, top}, null first), as the client API gives them."""
    prompt = "The capital of France is"

    async def main():
        async with connect(_ws(gateway_url)) as ws:
            await ws.recv()                                                    # hello
            await ws.send(json.dumps({"type": "generate", "id": 1, "prompt": prompt, "max_new_tokens": 3,
                                      "prompt_logprobs": 1}))
            return await _frames_until(ws, lambda f: f["type"] in ("done", "error"))

    frames = asyncio.run(main())
    tokens = [f for f in frames if f["type"] == "token"]
    [want] = deployment([prompt], max_new_tokens=3, prompt_logprobs=1)
    plps = tokens[0]["prompt_logprobs"]
    assert len(plps) == want.prompt_length and plps[0] is None
    assert [e["token_id"] for e in plps[1:]] == want.prompt_token_ids[1:]
    for e, w in zip(plps[1:], want.prompt_logprobs[1:]):
        assert abs(e["logprob"] - w.logprob) < 1e-4 and len(e["top"]) == 1
    assert all("prompt_logprobs" not in f for f in tokens[1:]) and frames[-1]["type"] == "done"
