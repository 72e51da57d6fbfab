"""DeepSpeed-MII's REST API (/generate, /mii/{name}) on the gateway, against the real deployment."""
from __future__ import annotations

import asyncio
import json

import httpx

from tests.mesh_helpers import kv_idle, until


def test_generate_with_the_mii_body(gateway_url, deployment):
    """The body DeepSpeed-MII users send gets a list of {generated_text, prompt_length, generated_length,
    finish_reason}, equal to what the client API gives."""
    body = {"prompts": ["你好，DeepSpeed-MII", "The capital of France is"], "max_new_tokens": 16}
    r = httpx.post(f"{gateway_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    expected = deployment(body["prompts"], max_new_tokens=16)
    assert [g["generated_text"] for g in got] == [e.generated_text for e in expected]
    for g, e in zip(got, expected):
        assert set(g) == {"generated_text", "prompt_length", "generated_length", "finish_reason"}
        assert (g["prompt_length"], g["generated_length"], g["finish_reason"]) == \
            (e.prompt_length, e.generated_length, e.finish_reason)


def test_logit_bias_and_guides_in_the_mii_body(gateway_url, deployment):
    """logit_bias with string ids (JSON's only kind of key) and guided_json reach the engine from REST: the
    answers equal the client API's with the same values."""
    [plain] = deployment(["The capital of France is"], max_new_tokens=2)
    tid = plain.token_ids[0]
    body = {"prompts": ["The capital of France is"], "max_new_tokens": 3, "logit_bias": {str(tid): -100}}
    r = httpx.post(f"{gateway_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    [expected] = deployment(body["prompts"], max_new_tokens=3, logit_bias={tid: -100})
    assert r.json()[0]["generated_text"] == expected.generated_text and expected.token_ids[0] != tid
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"]}
    body = {"prompts": ["The capital of France is"], "max_new_tokens": 24, "guided_json": schema}
    r = httpx.post(f"{gateway_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()[0]["generated_text"])) == {"answer"}


def test_mii_path_and_streaming(gateway_url, deployment):
    """POST /mii/{model name} answers like /generate; "stream": true sends SSE events per step ending in
    [DONE], whose text adds up to the non-streamed answer; an unknown deployment name is a 404."""
    name = deployment.run(deployment.health())["model_name"]
    body = {"prompts": "The capital of France is", "max_new_tokens": 12}
    plain = httpx.post(f"{gateway_url}/mii/{name}", json=body, timeout=60).json()
    with httpx.stream("POST", f"{gateway_url}/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert len(events) > 3 and "".join(e["text"] for e in events) == plain[0]["generated_text"]
    assert events[-1]["finish_reason"] == plain[0]["finish_reason"] and events[-1]["usage"]["completion_tokens"] == 12
    missing = httpx.post(f"{gateway_url}/mii/no-such-model", json=body, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "deployment_name"


def test_bad_bodies_are_400s_naming_the_parameter(gateway_url):
    """Malformed JSON, a missing prompts, an unknown or out-of-range parameter: 400 with the parameter named."""
    cases = [({"max_new_tokens": 4}, "prompts"), ({"prompts": []}, "prompts"), ({"prompts": ["a", 3]}, "prompts[1]"),
             ({"prompts": "a", "top_p": 2}, "top_p"), ({"prompts": "a", "max_lenght": 3}, "max_lenght"),
             ({"prompts": "a", "stream": "yes"}, "stream"), ({"prompts": "a", "max_new_tokens": 10 ** 7}, "max_new_tokens")]
    for body, param in cases:
        r = httpx.post(f"{gateway_url}/generate", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(f"{gateway_url}/generate", content=b'{"prompts": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{gateway_url}/generate", content=b"x" * (9 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_client_disconnect_aborts_sse_and_plain_requests(gateway_url, deployment):
    """Dropping the connection of a streaming and of a non-streaming request aborts both: KV back at baseline."""
    body = {"prompts": "Tell me a long story.", "max_new_tokens": 500, "ignore_eos": True}

    async def main():
        await kv_idle(deployment)
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{gateway_url}/generate", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break                              # one event, then hang up
        await kv_idle(deployment, timeout_s=10)
        plain = asyncio.create_task(httpx.AsyncClient(timeout=60).post(f"{gateway_url}/generate", json=body))
        await until(lambda: _running(deployment), 20, "the plain request to run")
        plain.cancel()                                     # closes its connection
        await asyncio.gather(plain, return_exceptions=True)
        await kv_idle(deployment, timeout_s=10)

    asyncio.run(main())


async def _running(client) -> bool:
    return (await client.stats()).get("running", 0) >= 1


def test_logprobs_and_prompt_logprobs_in_the_mii_body(gateway_url, deployment):
    """logprobs and prompt_logprobs asked in the body come back as the client API gives them: one
    {token_id, logprob, top} per generated token, one per prompt token (null first); streamed, the first event
    carries the prompt's."""
    body = {"prompts": ["The capital of France is"], "max_new_tokens": 3, "logprobs": 1, "prompt_logprobs": 2}
    r = httpx.post(f"{gateway_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    [got] = r.json()
    [want] = deployment(body["prompts"], max_new_tokens=3, logprobs=1, prompt_logprobs=2)
    assert [x["token_id"] for x in got["logprobs"]] == want.token_ids and len(got["logprobs"][0]["top"]) == 1
    assert [x["rank"] for x in got["logprobs"]] == [x.rank for x in want.logprobs] == [1, 1, 1]   # greedy
    plps = got["prompt_logprobs"]
    assert len(plps) == got["prompt_length"] and plps[0] is None
    for g, w in zip(plps[1:], want.prompt_logprobs[1:]):
        assert g["token_id"] == w.token_id and abs(g["logprob"] - w.logprob) < 1e-4
        assert [t[0] for t in g["top"]] == [t[0] for t in w.top]
    with httpx.stream("POST", f"{gateway_url}/generate", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert [x["token_id"] for x in events[0]["prompt_logprobs"][1:]] == want.prompt_token_ids[1:]
    assert all("prompt_logprobs" not in e for e in events[1:])
    assert [lp["token_id"] for e in events for lp in e["logprobs"]] == want.token_ids
