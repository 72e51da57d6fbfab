"""Every client method works from plain code (it runs to completion) and from a coroutine (it is awaited):
no call hands back a coroutine that silently does nothing. Against real deployments."""
from __future__ import annotations

import asyncio
import inspect
import uuid

import httpx
import pytest

import mii_async
from mii_async import deployment_registry
from mii_async.outputs import Response
from tests.mesh_helpers import kv_idle, wait_gone

PROMPT = "The capital of France is"


def test_client_methods_from_plain_code_and_from_a_coroutine(deployment):
    """generate, the call, stream, health, stats and reset_prefix_cache give their results from plain code,
    and awaitables (the same results) from a coroutine."""
    [plain] = deployment.generate([PROMPT], max_new_tokens=4)
    assert isinstance(plain, Response) and plain.generated_length == 4
    assert [r.token_ids for r in deployment(prompts=[PROMPT], max_new_tokens=4)] == [plain.token_ids]
    chunks = list(deployment.stream(PROMPT, max_new_tokens=4))
    assert "".join(c.text for c in chunks) == plain.generated_text and chunks[-1].finish_reason == "length"
    assert deployment.health()["state"] == "ready"
    assert "used_blocks" in deployment.stats()
    assert "prefix_blocks_forgotten" in deployment.reset_prefix_cache()

    async def main():
        pending = [deployment.generate([PROMPT], max_new_tokens=4), deployment([PROMPT], max_new_tokens=4),
                   deployment.health(), deployment.stats(), deployment.reset_prefix_cache()]
        assert all(inspect.isawaitable(p) for p in pending)
        [g], [c], health, stats, reset = [await p for p in pending]
        text = [chunk.text async for chunk in deployment.stream(PROMPT, max_new_tokens=4)]
        return g, c, health, stats, reset, "".join(text)

    g, c, health, stats, reset, text = asyncio.run(main())
    assert g.token_ids == c.token_ids == plain.token_ids and text == plain.generated_text
    assert health["state"] == "ready" and "used_blocks" in stats and "prefix_blocks_forgotten" in reset


def test_leaving_a_plain_stream_early_aborts_the_request(deployment):
    """A `for` over client.stream() left after 2 chunks, a stream closed after one, and a streaming_fn that
    raises each abort their request: the KV blocks are freed (the callback's error reaches the caller)."""
    for i, _ in enumerate(deployment.stream(PROMPT, max_new_tokens=2000, ignore_eos=True)):
        if i == 2:
            break
    assert asyncio.run(kv_idle(deployment, timeout_s=30.0))["running"] == 0
    stream = deployment.stream(PROMPT, max_new_tokens=2000, ignore_eos=True)
    assert next(stream).token_ids
    stream.close()
    assert asyncio.run(kv_idle(deployment, timeout_s=30.0))["running"] == 0
    pieces: list[Response] = []

    def callback(rs: list[Response]) -> None:
        pieces.extend(rs)
        if len(pieces) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        deployment.generate(PROMPT, streaming_fn=callback, max_new_tokens=2000, ignore_eos=True)
    assert len(pieces) == 3 and all(p.finish_reason is None for p in pieces)
    assert asyncio.run(kv_idle(deployment, timeout_s=30.0))["running"] == 0


def test_streaming_fn_from_a_coroutine_may_be_async(deployment):
    """Awaited, generate(streaming_fn=…) calls the callback on the caller's loop and awaits what it returns;
    the pieces make the answer."""
    pieces: list[str] = []

    async def callback(rs: list[Response]) -> None:
        await asyncio.sleep(0)
        pieces.append(rs[0].generated_text)

    async def main():
        return await deployment.generate(PROMPT, streaming_fn=callback, max_new_tokens=6)

    [r] = asyncio.run(main())
    assert len(pieces) >= 2 and "".join(pieces) == r.generated_text and r.generated_length == 6


def test_terminate_server_from_plain_code_through_a_client_found_by_name(tiny_llama):
    """A client found by name stops the deployment from plain code; the owner's wait_terminated() returns
    True, its gateway is stopped with it (GET /terminate was never on: 404) and the name is free again."""
    name = f"facade-{uuid.uuid4().hex[:8]}"
    owner = mii_async.serve(str(tiny_llama), deployment_name=name, enable_http=True, http_port=0, num_blocks=64)
    pids = [owner._process.pid, owner._gateway.pid]
    try:
        pids += [p for r in owner.health()["replicas"] for p in r["pids"]]
        assert httpx.get(f"{owner.http_url}/terminate", timeout=30).status_code == 404
        other = mii_async.client(name)
        assert other.address == owner.address
        assert other.terminate_server() is None
        assert owner.wait_terminated(60) is True
        assert not wait_gone(pids, timeout_s=30), "processes left behind"
        assert deployment_registry.find(name) is None
        other.close()
    finally:
        owner._process.stop()
        owner._gateway.stop()
        owner.close()


def test_terminate_route_wants_the_key_and_refuses_cross_site_requests(tiny_llama):
    """With enable_terminate=True and an API key: GET /terminate without the key is 401, a browser's
    cross-site request 403 (a web page cannot stop the deployment), with the key 200, and the deployment
    stops (awaited from a coroutine, wait_terminated returns True)."""
    owner = mii_async.serve(str(tiny_llama), enable_http=True, http_port=0, api_key="sesame", enable_terminate=True,
                            num_blocks=64)
    try:
        url, key = f"{owner.http_url}/terminate", {"Authorization": "Bearer sesame"}
        assert httpx.get(url, timeout=30).status_code == 401
        assert httpx.get(url, headers={**key, "Sec-Fetch-Site": "cross-site"}, timeout=30).status_code == 403
        assert owner.health()["state"] == "ready"
        r = httpx.get(url, headers=key, timeout=30)
        assert r.status_code == 200, r.text

        async def wait():
            return await owner.wait_terminated(60)

        assert asyncio.run(wait()) is True
        assert not wait_gone([owner._gateway.pid], timeout_s=30)
    finally:
        owner._process.stop()
        owner._gateway.stop()
        owner.close()


def test_wait_terminated_is_the_owners_alone(deployment):
    """A client that did not start the deployment cannot wait on its processes: an error naming why."""
    other = mii_async.client(deployment.address)
    try:
        with pytest.raises(mii_async.InvalidParameterError, match="only the client that serve"):
            other.wait_terminated(1)
    finally:
        other.close()
