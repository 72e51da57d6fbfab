"""The official `openai` package, unmodified, against the gateway's OpenAI-compatible routes."""
from __future__ import annotations

import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def oai(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def test_models_lists_the_served_model(oai, deployment):
    """GET /v1/models lists one model, named as the router serves it."""
    models = oai.models.list().data
    assert [m.id for m in models] == [deployment.run(deployment.health())["model_name"]]


def test_chat_completion_answers_paris(oai, model, deployment):
    """chat.completions: greedy answer with the chat template equals the client API's, with usage counts."""
    r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    [expected] = deployment([QUESTION], max_new_tokens=16)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.generated_text and "Paris" in expected.generated_text
    assert r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (expected.prompt_length, expected.generated_length)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_with_usage(oai, model):
    """stream=True yields a role delta, content deltas, a finish_reason, then a usage chunk; the text equals
    the non-streamed answer."""
    plain = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    chunks = list(oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions_stop_seed_n_logprobs(oai, model):
    """completions: stop strings cut the text, a seed makes sampling reproducible, n gives n choices, and
    logprobs come in the completions format, one per token."""
    greedy = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                    stop=["."])
    assert greedy.choices[0].text.strip() == "Paris" and greedy.choices[0].finish_reason == "stop"
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=11, n=2)
    a, b = oai.completions.create(**kw), oai.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1] and a.choices[0].text != a.choices[1].text
    lp = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                                logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens).startswith(" Paris") and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_completion_streaming_and_chat_logprobs(oai, model):
    """Streamed completions add up to the plain one; chat logprobs carry tokens and top alternatives."""
    plain = oai.completions.create(model=model, prompt="List three colours:", max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=model, prompt="List three colours:", max_tokens=10, temperature=0, stream=True))
    assert streamed == plain.choices[0].text
    r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True,
                                    top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_logit_bias_forces_and_bans_tokens(oai, model, deployment, gateway_url):
    """logit_bias as OpenAI sends it (ids as strings): −100 on the greedy answer's first token makes the answer
    start otherwise, as the client API's with the same bias; +100 on one token makes every greedy token that
    one; a bias outside [-100, 100] is a 400 naming logit_bias."""
    prompt = "The capital of France is"
    [plain] = deployment([prompt], max_new_tokens=3)
    first = plain.token_ids[0]
    banned = oai.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                    logit_bias={str(first): -100})
    [expected] = deployment([prompt], max_new_tokens=3, logit_bias={first: -100})
    assert expected.token_ids[0] != first and banned.choices[0].text == expected.generated_text
    other = expected.token_ids[0]
    [forced] = deployment([prompt], max_new_tokens=3, logit_bias={other: 100})
    assert forced.token_ids == [other] * 3
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, logit_bias={str(other): 100})
    assert r.choices[0].text == forced.generated_text
    r = httpx.post(f"{gateway_url}/v1/completions", timeout=30,
                   json={"model": model, "prompt": prompt, "logit_bias": {str(first): 250}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_response_format_guides_the_answer(oai, model, deployment, gateway_url):
    """response_format json_schema gives JSON that the schema admits, the same text as the client API with
    guided_json; json_object gives a JSON object; a schema the compiler refuses is a 400 naming
    response_format; a regex the replica cannot compile ends that request with finish_reason "error"."""
    import json

    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["capital", "country"]}
    r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=48, temperature=0,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "answer", "schema": schema}})
    doc = json.loads(r.choices[0].message.content)
    assert set(doc) == {"capital", "country"} and r.choices[0].finish_reason == "stop"
    [expected] = deployment([QUESTION], max_new_tokens=48, guided_json=schema)
    assert r.choices[0].message.content == expected.generated_text
    r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=200, temperature=0,
                                    response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                    response_format={"type": "json_schema", "json_schema": {"schema": {"type": "x"}}})
    assert e.value.body["param"] == "response_format"
    r = oai.completions.create(model=model, prompt="Pick:", max_tokens=4, temperature=0,
                               extra_body={"guided_choice": ["red", "green"]})
    assert r.choices[0].text in ("red", "green")
    [failed] = deployment(["x"], max_new_tokens=4, guided_regex="a(?=b)")
    assert failed.finish_reason == "error"


def test_errors_in_openai_format(oai, model, gateway_url):
    """Invalid input is a 400 naming the parameter, an unknown model a 404, both as the openai package's
    typed errors; a request that can never fit is a 400 on max_tokens."""
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="x", max_tokens=10 ** 6)
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "request_too_long"
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
