"""Operations on the gateway: /health, /metrics, the API key, overload and replica loss — against real
processes (a second deployment started with serve(enable_http=True), and the session's)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

import mii_async
from mii_async.gateway.metrics import Metrics
from tests.mesh_helpers import deployment_pids, kv_idle, until, wait_gone

KEY = "s3cret-key-for-tests"


@pytest.fixture(scope="module")
def small(default_model_dir):
    """serve(enable_http=True) with an API key (from $MII_ASYNC_API_KEY, as a user would keep it off argv), one
    running sequence and 2 queued requests at most."""
    old = os.environ.get("MII_ASYNC_API_KEY")
    os.environ["MII_ASYNC_API_KEY"] = KEY
    try:
        client = mii_async.serve(str(default_model_dir), kv_cache_memory=0.1, max_num_seqs=1, max_queued_requests=2,
                                 enable_http=True, http_port=0)
    finally:
        if old is None:
            os.environ.pop("MII_ASYNC_API_KEY")
        else:
            os.environ["MII_ASYNC_API_KEY"] = old
    pids = [client._process.pid, client._gateway.pid] + deployment_pids(client.run(client.health()))
    yield client
    client.terminate_server_sync(drain_s=0)
    assert not wait_gone(pids), "processes left behind"


def _metrics(url: str, **kw) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=10, **kw).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_health_and_metrics(gateway_url):
    """/health is 200 when ready; /metrics counts requests by status, tokens exactly, latency histograms, and
    reports the KV blocks, queue depth and replica states."""
    h = httpx.get(f"{gateway_url}/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ready" and h.json()["replicas"] == {"0": "ready"}
    before = _metrics(gateway_url)
    r = httpx.post(f"{gateway_url}/generate", json={"prompts": ["a", "b"], "max_new_tokens": 7, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200
    after = _metrics(gateway_url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("mii_async_requests_total", api="generate", status="length") == 2
    assert delta("mii_async_generation_tokens_total", api="generate") == 14
    assert delta("mii_async_prompt_tokens_total", api="generate") == sum(x["prompt_length"] for x in r.json())
    assert delta("mii_async_time_to_first_token_seconds_count", api="generate") == 2
    assert delta("mii_async_inter_token_latency_seconds_count", api="generate") >= 2
    assert delta("mii_async_e2e_request_latency_seconds_count", api="generate") == 2
    assert after[("mii_async_replica_up", (("replica", "0"), ("state", "ready")))] == 1
    assert after[("mii_async_kv_blocks", (("state", "free"),))] > 0
    assert after[("mii_async_replica_stats_up", (("replica", "0"),))] == 1
    assert after[("mii_async_replica_kv_blocks", (("replica", "0"), ("state", "free")))] \
        == after[("mii_async_kv_blocks", (("state", "free"),))]
    assert ("mii_async_queue_depth", ()) in after and ("mii_async_requests_in_flight", (("api", "generate"),)) in after
    # the replicas' own counters: both prompts were looked up in the prefix cache, and steps ran
    queried = delta("mii_async_prefix_cache_query_tokens_total", replica="0")
    assert queried == sum(x["prompt_length"] for x in r.json())
    assert 0 <= delta("mii_async_prefix_cache_hit_tokens_total", replica="0") <= queried
    assert delta("mii_async_engine_steps_total", replica="0") >= 7
    assert ("mii_async_preemptions_total", (("replica", "0"),)) in after


def _rendered(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(metrics.render().decode()) for s in fam.samples}


def _replica_stats(used: int, free: int, steps: int) -> dict:
    return {"num_blocks": used + free, "used_blocks": used, "free_blocks": free, "cached_blocks": 1, "running": 1,
            "waiting": 2, "prefix_hit_tokens": 0, "prefix_query_tokens": 5, "preemptions": 0, "steps": steps}


def test_metrics_of_a_replica_that_did_not_answer_are_absent():
    """A replica busy in a long engine step misses the router's stats deadline: the router lists it under
    `unanswered` and sums only the others. /metrics then shows it as unknown — replica_stats_up 0 and none of
    its samples — and leaves out the totals (a partial sum, or the zeros of an unanswered query, would read
    as a small or exhausted KV pool); the replica that answered keeps its own samples. Once every replica
    answers, the totals are back."""
    m = Metrics()
    health = {"state": "ready", "live_requests": 1,
              "replicas": [{"replica": 0, "state": "ready"}, {"replica": 1, "state": "ready"}]}
    one = _replica_stats(used=3, free=61, steps=9)
    partial = {"num_blocks": 64, "used_blocks": 3, "free_blocks": 61, "cached_blocks": 1, "running": 1, "waiting": 2,
               "prefix_hit_tokens": 0, "prefix_query_tokens": 5, "preemptions": 0, "steps": 9,
               "replicas": {"0": one}, "unanswered": [1]}
    m.observe_deployment(health, partial)
    got = _rendered(m)
    assert got[("mii_async_replica_stats_up", (("replica", "0"),))] == 1
    assert got[("mii_async_replica_stats_up", (("replica", "1"),))] == 0
    assert got[("mii_async_replica_kv_blocks", (("replica", "0"), ("state", "free")))] == 61
    assert not [k for k in got if k[0] in ("mii_async_kv_blocks", "mii_async_queue_depth", "mii_async_running_requests")]
    assert not [k for k in got if ("replica", "1") in k[1] and k[0] != "mii_async_replica_stats_up"
                and k[0] != "mii_async_replica_up"]
    assert got[("mii_async_engine_steps_total", (("replica", "0"),))] == 9

    # every replica silent (one replica, in a long step): the router's totals are its zeros — none is shown
    m.observe_deployment({**health, "replicas": health["replicas"][:1]},
                         {**dict.fromkeys(one, 0), "replicas": {}, "unanswered": [0]})
    got = _rendered(m)
    assert got[("mii_async_replica_stats_up", (("replica", "0"),))] == 0
    assert not [k for k in got if "kv_blocks" in k[0] or k[0].startswith("mii_async_engine_steps")]
    # the router gave no stats at all: the ready replicas are unknown, not stale
    m.observe_deployment(health, None)
    got = _rendered(m)
    assert [got[("mii_async_replica_stats_up", (("replica", r),))] for r in "01"] == [0, 0]
    assert not [k for k in got if "kv_blocks" in k[0] or k[0] == "mii_async_queue_depth"]

    two = _replica_stats(used=5, free=59, steps=4)
    m.observe_deployment(health, {"num_blocks": 128, "used_blocks": 8, "free_blocks": 120, "cached_blocks": 2,
                                  "running": 2, "waiting": 4, "prefix_hit_tokens": 0, "prefix_query_tokens": 10,
                                  "preemptions": 0, "steps": 13, "replicas": {"0": one, "1": two}, "unanswered": []})
    got = _rendered(m)
    assert got[("mii_async_kv_blocks", (("state", "used"),))] == 8
    assert got[("mii_async_kv_blocks", (("state", "free"),))] == 120
    assert got[("mii_async_queue_depth", ())] == 4 and got[("mii_async_running_requests", ())] == 2
    assert got[("mii_async_replica_kv_blocks", (("replica", "1"), ("state", "used")))] == 5
    assert [got[("mii_async_replica_stats_up", (("replica", r),))] for r in "01"] == [1, 1]


def test_too_large_bodies_are_counted_and_head_of_the_page(gateway_url):
    """A body over the limit is a 413 counted under request_too_large, whether it says its length or comes in
    chunks; HEAD / answers 200 (uptime checkers), as HEAD /health does."""
    before = _metrics(gateway_url)
    big = b"x" * (9 << 20)
    r = httpx.post(f"{gateway_url}/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(f"{gateway_url}/generate", content=iter([big[:1 << 20]] * 9),
                   headers={"content-type": "application/json"})           # chunked: no Content-Length
    assert r.status_code == 413
    key = ("mii_async_requests_total", (("api", "generate"), ("status", "request_too_large")))
    assert _metrics(gateway_url).get(key, 0) - before.get(key, 0) == 2
    assert httpx.head(f"{gateway_url}/", timeout=10).status_code == 200


def test_reset_prefix_cache_route(gateway_url):
    """POST /reset_prefix_cache: the replicas forget their cached prefixes; a repeated prompt is then computed
    again (no cached tokens in its usage)."""
    model = httpx.get(f"{gateway_url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The quick brown fox jumps over the lazy dog. " * 6, "max_tokens": 3,
            "temperature": 0}
    httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=60)
    again = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = httpx.post(f"{gateway_url}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json()["prefix_blocks_forgotten"] > 0 and set(r.json()["replicas"]) == {"0"}
    cold = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=60).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["text"] == again["choices"][0]["text"]


def test_api_key_on_every_route(small):
    """With an API key, every route (the page, static files, health, metrics, REST, OpenAI, the WebSocket)
    answers 401 without it or with a wrong one, and works with it as a bearer token, X-API-Key or api_key=."""
    url = small.http_url
    routes = [("GET", "/"), ("GET", "/static/chat.js"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
              ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/generate"), ("GET", "/nope")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": KEY[:-1]}):
            r = httpx.request(method, url + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.json()["error"]["type"] == "authentication_error"
    ok = [httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}),
          httpx.get(f"{url}/v1/models", headers={"X-API-Key": KEY}), httpx.get(f"{url}/?api_key={KEY}")]
    assert [r.status_code for r in ok] == [200, 200, 200]

    async def ws(query: str):
        async with connect(url.replace("http", "ws") + "/v1/ws" + query) as s:
            return await s.recv()

    with pytest.raises(InvalidStatus) as e:
        asyncio.run(ws(""))
    assert e.value.response.status_code == 401
    assert '"hello"' in asyncio.run(ws(f"?api_key={KEY}"))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    r = good.chat.completions.create(model=good.models.list().data[0].id, temperature=0, max_tokens=12,
                                     messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


def test_overload_is_503(small):
    """Past max_queued_requests the gateway answers 503 (OpenAI format, Retry-After), and the openai
    package sees it as an error; once the queue drains, requests succeed."""
    url, headers = small.http_url, {"Authorization": f"Bearer {KEY}"}

    async def main():
        await kv_idle(small)

        async def hold():
            async for _ in small.stream("Tell me a long story.", max_new_tokens=500, ignore_eos=True):
                pass

        holders = [asyncio.create_task(hold()) for _ in range(2)]
        await until(lambda: _queued(small, 2), 20, "two live requests")
        async with httpx.AsyncClient(timeout=30, headers=headers) as http:
            r = await http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            ws_like = await http.post(f"{url}/generate", json={"prompts": "x", "max_new_tokens": 2, "stream": True})
        for t in holders:
            t.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        await kv_idle(small)
        return r, ws_like

    r, streamed = asyncio.run(main())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded" and "max_queued_requests" in r.json()["error"]["message"]
    assert streamed.status_code == 503                         # refused before any event is sent
    m = _metrics(url, headers=headers)
    assert m[("mii_async_requests_total", (("api", "completions"), ("status", "overloaded")))] == 1
    assert m[("mii_async_requests_total", (("api", "generate"), ("status", "overloaded")))] == 1
    ok = httpx.post(f"{url}/generate", json={"prompts": "hi", "max_new_tokens": 2}, headers=headers, timeout=30)
    assert ok.status_code == 200


async def _queued(client, n: int) -> bool:
    s = await client.stats()
    return s["running"] + s["waiting"] == n


def test_worker_death_mid_stream_and_health(small):
    """kill -9 of the only worker during an SSE stream: the stream ends with an error event, the usage of what
    was streamed, then [DONE]; /health answers 503 until the replacement is ready, then 200 again."""
    import json

    url, headers = small.http_url, {"Authorization": f"Bearer {KEY}"}
    [pid] = deployment_pids(small.run(small.health()))
    body = {"prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        os.kill(pid, signal.SIGKILL)
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert "choices" in json.loads(first[6:])
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-3][6:])["error"]
    assert error["code"] == "generation_failed" and error["type"] == "internal_error"
    chunks = 1 + len(rest) - 3                     # each carries a token
    usage = json.loads(rest[-2][6:])["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] >= chunks, (usage, chunks)
    deadline = time.monotonic() + 10
    codes = set()
    while time.monotonic() < deadline and 503 not in codes:
        codes.add(httpx.get(f"{url}/health", headers=headers, timeout=10).status_code)
        time.sleep(0.1)
    assert 503 in codes
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health", headers=headers, timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "no replacement replica"
        time.sleep(0.5)


def test_health_is_503_without_a_router(tmp_path):
    """A gateway whose router does not answer starts, and /health says 503 unavailable, naming the cause."""
    import socket

    from mii_async.config import HttpConfig
    from mii_async.deployment import GatewayProcess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gw = GatewayProcess(f"tcp://127.0.0.1:{port}", HttpConfig(http_port=0))
    try:
        r = httpx.get(f"{gw.url}/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        assert not r.json()["error"].endswith(": "), r.json()["error"]     # a timeout's str() is empty
    finally:
        gw.stop()
    assert not wait_gone([gw.pid])
