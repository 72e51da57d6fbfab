"""The OpenAI-compatible routes' refusals, through the official `openai` package and plain HTTP: each a 400 (or
404, 405, 413) in OpenAI's error format, naming the parameter as the caller sent it."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from mii_async.gateway.openai_routes import _chat_rename
from mii_async.gateway.openai_schemas import ChatCompletionRequest
from mii_async.gateway.tool_mode import tool_mode

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_http_plumbing_answers_as_clients_expect(gateway_url):
    """HEAD /health (some load balancers' checks) is 200; a wrong method is 405 naming the allowed one."""
    assert httpx.head(f"{gateway_url}/health", timeout=30).status_code == 200
    r = httpx.put(f"{gateway_url}/v1/completions", json={}, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == "method_not_allowed"


def test_errors_in_openai_format(oai, model, gateway_url):
    """Invalid input is a 400 naming the parameter, an unknown model a 404, both as the openai package's
    typed errors; a request that can never fit is a 400 on max_tokens."""
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="x", max_tokens=10 ** 6)
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "request_too_long"
    assert "max_tokens (1000000)" in e.value.body["message"] and "max_new_tokens" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="x", extra_body={"max_tokenz": 3})
    assert e.value.body["param"] == "max_tokenz"
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model"
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json={"model": model, "messages": QUESTION, "n": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    # OpenAI's fields we cannot honour are refused at any value but their neutral one, by name
    for field, value in (("store", True), ("service_tier", "gold"), ("reasoning_effort", "extreme"),
                         ("modalities", ["text", "audio"])):
        r = httpx.post(f"{gateway_url}/v1/chat/completions",
                       json={"model": model, "messages": QUESTION, "max_tokens": 2, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json={"model": model, "messages": QUESTION, "max_tokens": 2,
                                                              "store": False, "service_tier": "auto"})
    assert r.status_code == 200
    # a prompt that alone fills the context names the prompt (messages, on chat), not max_tokens
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=[5] * 200_000, max_tokens=1)
    assert e.value.body["param"] == "prompt"


def test_values_that_overflow_the_wire(oai, model, gateway_url):
    """Token ids outside uint32 and integers too large for any count are 400s naming the parameter (not a
    plain-text 500); so is a fan-out of prompts × n past 1024 choices; a chunked body over the limit is 413."""
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=[1, 2 ** 40], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=[[5, -3]], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    for extra in ({"top_k": 10 ** 30}, {"max_tokens": 10 ** 30}, {"temperature": 10 ** 400}, {"stop_token_ids": [-1]}):
        r = httpx.post(f"{gateway_url}/v1/completions", json={"model": model, "prompt": "x", **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), (extra, r.text)
    r = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=30,
                   json={"model": model, "messages": QUESTION, "logprobs": True, "top_logprobs": 50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(f"{gateway_url}/v1/completions", json={"model": model, "prompt": ["x"] * 100, "n": 16}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"

    def chunks():
        for _ in range(10):
            yield b" " * (1 << 20)

    r = httpx.post(f"{gateway_url}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    r = httpx.get(f"{gateway_url}/v1/nowhere", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


# (route, field, value): integers and booleans sent as strings, booleans or floats are never coerced
COERCED = [("completions", f, v) for f in ("max_tokens", "n", "seed", "logprobs", "top_k", "min_tokens",
                                           "prompt_logprobs", "best_of") for v in ("5", True, 5.0)] \
    + [("completions", f, v) for f in ("echo", "stream", "ignore_eos", "skip_special_tokens") for v in ("true", 1)] \
    + [("completions", "temperature", "0.5"), ("completions", "stop_token_ids", [True]),
       ("completions", "prompt", [1, True])] \
    + [("chat", f, v) for f in ("max_tokens", "max_completion_tokens", "top_logprobs", "n", "seed")
       for v in ("2", True)] \
    + [("chat", f, v) for f in ("logprobs", "stream", "parallel_tool_calls") for v in ("true", 1)]


@pytest.mark.parametrize("route,field,value", COERCED)
def test_integers_and_booleans_are_strict(gateway_url, model, route, field, value):
    """`"max_tokens": "5"`, `true` or `5.0` for an integer, `1` or `"true"` for a boolean: a 400 in OpenAI's
    shape naming the field, as OpenAI answers, not a silent coercion."""
    body = {"model": model, "prompt": "x"} if route == "completions" else {"model": model, "messages": QUESTION}
    r = httpx.post(f"{gateway_url}/v1/{'completions' if route == 'completions' else 'chat/completions'}",
                   json={**body, "max_tokens": 2, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split("[")[0] == field and err["message"].startswith(err["param"]), r.text   # [i]: a list's
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_parameter", r.text


def test_strict_fields_still_take_their_types(oai, model, gateway_url):
    """Real integers and booleans (and an integer for a float) pass the strict schemas."""
    c = oai.completions.create(model=model, prompt="x", max_tokens=3, n=2, seed=1, logprobs=1, echo=False,
                               temperature=1, extra_body={"top_k": 5, "ignore_eos": True, "min_tokens": 3})
    assert [len(ch.logprobs.tokens) for ch in c.choices] == [3, 3] and c.usage.completion_tokens == 6
    chat = oai.chat.completions.create(model=model, messages=QUESTION, max_completion_tokens=2, logprobs=True,
                                       top_logprobs=2, stream=False)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def test_rest_and_websocket_types_are_strict(gateway_url):
    """REST bodies and WebSocket frames take SamplingParams' strict checks: a string or a boolean for an
    integer is refused by name (400 / an error frame), a real integer runs."""
    for value in ("5", True):
        r = httpx.post(f"{gateway_url}/generate", json={"prompts": "x", "max_new_tokens": value}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_new_tokens", r.text
    r = httpx.post(f"{gateway_url}/generate", json={"prompts": "x", "ignore_eos": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text
    r = httpx.post(f"{gateway_url}/generate", json={"prompts": "x", "max_new_tokens": 2, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()[0]["generated_length"] == 2

    async def main():
        async with connect(gateway_url.replace("http://", "ws://") + "/v1/ws") as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
            for i, (field, value) in enumerate((("max_new_tokens", "5"), ("seed", True), ("ignore_eos", 1))):
                await ws.send(json.dumps({"type": "generate", "id": i, "prompt": "x", field: value}))
                async with asyncio.timeout(30):
                    f = json.loads(await ws.recv())
                assert f["type"] == "error" and f["id"] == i and f["param"] == field, f

    asyncio.run(main())


def test_a_refused_guide_is_named_as_the_chat_request_gave_it():
    """The replica names a guide it cannot compile guided_json; a chat request that asked through
    response_format or tools reads that name."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plain = ChatCompletionRequest(messages=QUESTION)
    fmt = ChatCompletionRequest(messages=QUESTION, response_format={"type": "json_object"})
    assert "guided_json" not in _chat_rename(plain, None)
    assert _chat_rename(fmt, None)["guided_json"] == "response_format"
    assert _chat_rename(plain, tool_mode(tools, "required", None))["guided_json"] == "tools"
    assert "guided_json" not in _chat_rename(plain, tool_mode(tools, "auto", None))
    assert _chat_rename(plain, None)["max_new_tokens"] == "max_tokens"
