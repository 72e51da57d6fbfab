"""The official `openai` package, unmodified, against the gateway's OpenAI-compatible routes."""
from __future__ import annotations

import httpx
import openai
import pytest

import mii_async

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model(oai, deployment):
    """GET /v1/models lists one model, named as the router serves it."""
    models = oai.models.list().data
    assert [m.id for m in models] == [deployment.run(deployment.health())["model_name"]]
    assert oai.models.retrieve(models[0].id).id == models[0].id            # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("some/other-model")


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
    # vLLM's continuous_usage_stats: every chunk carries the usage so far
    chunks = list(oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0,
                                              stream=True, stream_options={"include_usage": True,
                                                                           "continuous_usage_stats": True}))
    running = [c.usage.completion_tokens for c in chunks]
    assert running == sorted(running) and running[0] == 0 and running[-1] == plain.usage.completion_tokens
    assert {c.usage.prompt_tokens for c in chunks} == {plain.usage.prompt_tokens}


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
    zero = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=1.0,
                                  seed=3, logprobs=0).choices[0].logprobs
    assert [list(top.items()) for top in zero.top_logprobs] == \
        [[(t, v)] for t, v in zip(zero.tokens, zero.token_logprobs)]     # logprobs=0: the chosen token's own


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
    assert all(bytes(t.bytes) == t.token.encode() for t in content)
    # Where a token holds part of a character its text is U+FFFD, but its bytes are the token's own, so that
    # joined they spell the answer (SmolLM writes each of these emoji as two byte-level tokens).
    emoji = [{"role": "user", "content": "Reply with only emojis: 😀😃😄🎉"}]
    r = oai.chat.completions.create(model=model, messages=emoji, max_tokens=12, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert any(t.token == "\ufffd" for t in content)
    assert bytes(b for t in content for b in t.bytes).decode() == r.choices[0].message.content


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
    # a regex the replica can never compile (a lookahead; anchors) is a 400 naming it, streamed or not
    with pytest.raises(mii_async.InvalidParameterError) as e:
        deployment(["x"], max_new_tokens=4, guided_regex="a(?=b)")
    assert e.value.param == "guided_regex"
    for stream in (False, True):
        r = httpx.post(f"{gateway_url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 4,
                                                               "guided_regex": "^(yes|no)$", "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text


def test_completions_echo_with_logprobs(oai, model, deployment):
    """echo with logprobs (OpenAI's prompt logprobs): the text is the prompt then the completion, and the
    logprobs cover the prompt's tokens (the first with null logprob and top) then the completion's, with
    offsets into that text; the values are the client API's prompt_logprobs and logprobs. Streamed, the first
    chunk carries the prompt's part with the echoed text, and the chunks add up to the same."""
    prompt = "The capital of France is"
    [ref] = deployment([prompt], max_new_tokens=4, prompt_logprobs=2, logprobs=2)
    n = ref.prompt_length
    kw = dict(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    c = oai.completions.create(**kw).choices[0]
    lp = c.logprobs
    assert c.text == prompt + ref.generated_text and "".join(lp.tokens) == c.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [x.logprob for x in ref.prompt_logprobs[1:]] + [x.logprob for x in ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(2 <= len(top) <= 3 and top[t] == v                  # the top 2, and the token itself
               for top, t, v in zip(lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:]))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n + 4)]
    chunks = [ch.choices[0] for ch in oai.completions.create(**kw, stream=True) if ch.choices]
    assert chunks[0].text == prompt and len(chunks[0].logprobs.tokens) == n
    parts = [ch.logprobs for ch in chunks if ch.logprobs is not None]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert [v for p in parts for v in p.token_logprobs][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    assert "".join(ch.text for ch in chunks) == c.text


def test_vllm_prompt_logprobs(model, deployment, gateway_url):
    """vLLM's prompt_logprobs: per choice on completions, once per response on chat, null first, then for each
    prompt token {id: {logprob, rank, decoded_token}} for the token and the top n; values as the client API's,
    the prompt token's rank its rank in the whole vocabulary (past n when it is not among the top n).
    With stream, or out of [0, 20], it is a 400 naming prompt_logprobs; max_tokens 0 with echo (a prompt scored
    without generating) is a 400 naming max_tokens."""
    prompt = "The capital of France is"
    [ref] = deployment([prompt], max_new_tokens=2, prompt_logprobs=2)
    r = httpx.post(f"{gateway_url}/v1/completions", timeout=60,
                   json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    plps = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plps) == ref.prompt_length and plps[0] is None
    for got, want in zip(plps[1:], ref.prompt_logprobs[1:]):
        mine = got[str(want.token_id)]
        assert mine["logprob"] == pytest.approx(want.logprob, abs=1e-4) and mine["decoded_token"]
        top_ids = [i for i, _ in want.top]
        assert {int(k) for k in got} == set(top_ids) | {want.token_id}
        assert [got[str(i)]["rank"] for i in top_ids] == [1, 2]
        assert mine["rank"] == want.rank == (top_ids.index(want.token_id) + 1 if want.token_id in top_ids
                                             else mine["rank"]) and mine["rank"] >= 1
        assert (mine["rank"] > 2) == (want.token_id not in top_ids)
    r = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": QUESTION, "max_tokens": 2, "prompt_logprobs": 0, "n": 2,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"] and body["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:]) and "prompt_logprobs" not in body["choices"][0]
    for extra, param in (({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                         ({"prompt_logprobs": 21}, "prompt_logprobs"),
                         ({"echo": True, "logprobs": 2, "prompt_logprobs": -1}, "prompt_logprobs")):
        r = httpx.post(f"{gateway_url}/v1/completions", json={"model": model, "prompt": prompt, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_prompt_logprobs_map_to_sampling_params():
    """The mapping alone (no server): echo with logprobs n asks prompt_logprobs n (vLLM's prompt_logprobs when
    larger); prompt_logprobs alone passes through on both routes; max_tokens 0 with echo, prompt_logprobs with
    stream, logprobs past 20 and stream_options without stream are refused naming what the caller sent."""
    import asyncio

    from mii_async.gateway.http_errors import HTTPError
    from mii_async.gateway.openai_params import chat_jobs, completion_jobs
    from mii_async.gateway.openai_schemas import ChatCompletionRequest, CompletionRequest

    [job] = completion_jobs(CompletionRequest(prompt="x", echo=True, logprobs=2))
    assert (job.params["logprobs"], job.params["prompt_logprobs"]) == (2, 2)
    [job] = completion_jobs(CompletionRequest(prompt="x", echo=True, logprobs=2, prompt_logprobs=5))
    assert job.params["prompt_logprobs"] == 5
    [job] = completion_jobs(CompletionRequest(prompt="x", logprobs=2))
    assert "prompt_logprobs" not in job.params
    [job] = asyncio.run(chat_jobs(ChatCompletionRequest(messages=QUESTION, max_tokens=3, prompt_logprobs=0), None))
    assert job.params["prompt_logprobs"] == 0
    for body, param in ((CompletionRequest(prompt="x", prompt_logprobs=1, stream=True), "prompt_logprobs"),
                        (CompletionRequest(prompt="x", echo=True, logprobs=21), "logprobs"),
                        (CompletionRequest(prompt="x", stream_options={"include_usage": True}), "stream_options")):
        with pytest.raises(HTTPError) as e:
            completion_jobs(body)
        assert e.value.param == param, body
    with pytest.raises(HTTPError) as e:            # stream_options without stream, as OpenAI and vLLM refuse it
        asyncio.run(chat_jobs(ChatCompletionRequest(messages=QUESTION, stream=False,
                                                    stream_options={"include_usage": True}), None))
    assert e.value.param == "stream_options"


def test_lm_eval_loglikelihood_request(model, deployment, gateway_url):
    """lm-eval-harness's local-completions loglikelihood request (a batch of token-id prompts, echo, max_tokens
    1, logprobs 1, temperature 0, a seed) is answered: token_logprobs are the prompt's logprobs (null first) then
    the one sampled token's, so its [ctxlen:-1] slice is the continuation's; its greedy test (a token's logprob
    is the max of its top) holds exactly where the prompt token is the model's top choice."""
    texts = ["The capital of France is Paris", "Two plus two equals four"]
    refs = deployment(texts, max_new_tokens=1, prompt_logprobs=1, logprobs=1)
    prompts = [r.prompt_token_ids for r in refs]
    r = httpx.post(f"{gateway_url}/v1/completions", timeout=60,
                   json={"model": model, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
                         "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for c, ref, ids in zip(choices, refs, prompts):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [x.logprob for x in ref.prompt_logprobs[1:]]
        assert lp["token_logprobs"][1:-1] == pytest.approx(want, abs=1e-4)
        assert lp["token_logprobs"][-1] == pytest.approx(ref.logprobs[0].logprob, abs=1e-4)
        ctxlen = len(ids) - 1                          # the last prompt token is the continuation
        assert lp["token_logprobs"][ctxlen:-1] == pytest.approx(want[ctxlen - 1:], abs=1e-4)
        for got, top, x in zip(lp["token_logprobs"][1:-1], lp["top_logprobs"][1:-1], ref.prompt_logprobs[1:]):
            assert len(top) == (1 if x.top[0][0] == x.token_id else 2)   # the top 1, and the token if not it
            assert (got == max(top.values())) == (x.top[0][0] == x.token_id), (x, top)


def test_n_choices_share_the_first_choices_prompt_logprobs(model, deployment, gateway_url, oai):
    """With n > 1 only a prompt's first choice asks the engine for its logprobs; every choice still shows them
    (echo's prompt part, vLLM's list), equal to the client API's, streamed (each choice's first chunk) or not."""
    prompt = "The capital of France is"
    [ref] = deployment([prompt], max_new_tokens=3, prompt_logprobs=2)
    want = [x.logprob for x in ref.prompt_logprobs[1:]]
    n = ref.prompt_length
    r = httpx.post(f"{gateway_url}/v1/completions", timeout=60,
                   json={"model": model, "prompt": prompt, "max_tokens": 3, "n": 3, "seed": 5, "echo": True,
                         "logprobs": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    for c in choices:
        lp = c["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:n] == pytest.approx(want, abs=1e-4)
        assert len(lp["tokens"]) == n + 3 and c["text"].startswith(prompt)
        assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(n + 3)]
        assert c["prompt_logprobs"] == choices[0]["prompt_logprobs"] and len(c["prompt_logprobs"]) == n
    stream = oai.completions.create(model=model, prompt=prompt, max_tokens=3, n=3, seed=5, echo=True, logprobs=2,
                                    stream=True)
    firsts = {}
    for ch in stream:
        for c in ch.choices:
            firsts.setdefault(c.index, c)
    assert sorted(firsts) == [0, 1, 2]
    for c in firsts.values():
        assert c.text == prompt and c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)


def test_one_asking_choice_per_prompt_and_prompt_logprobs_checked_as_sent():
    """The mapping alone: of n choices only each prompt's first asks for prompt_logprobs (chat too); a
    prompt_logprobs out of [0, 20] is a 400 naming it even when echo with logprobs would raise it."""
    import asyncio

    from mii_async.gateway.http_errors import HTTPError
    from mii_async.gateway.openai_params import chat_jobs, completion_jobs
    from mii_async.gateway.openai_schemas import ChatCompletionRequest, CompletionRequest

    jobs = completion_jobs(CompletionRequest(prompt=["a", "b"], n=3, echo=True, logprobs=1))
    assert [(j.index, j.prompt_index, "prompt_logprobs" in j.params) for j in jobs] == [
        (0, 0, True), (1, 0, False), (2, 0, False), (3, 1, True), (4, 1, False), (5, 1, False)]
    assert all(j.params["logprobs"] == 1 for j in jobs)
    jobs = asyncio.run(chat_jobs(ChatCompletionRequest(messages=QUESTION, max_tokens=3, n=2, prompt_logprobs=0), None))
    assert ["prompt_logprobs" in j.params for j in jobs] == [True, False]
    for v in (-1, 21):
        with pytest.raises(HTTPError) as e:
            completion_jobs(CompletionRequest(prompt="x", echo=True, logprobs=2, prompt_logprobs=v))
        assert e.value.param == "prompt_logprobs", v


def test_prompt_parts_are_rendered_once_from_the_chunks_texts():
    """The prompt's echo and vLLM parts are rendered once for all the choices of a prompt, from the first
    choice's chunk (the only one that asked), with the texts that chunk carries (the first prompt token's too,
    which has no Logprob): the gateway has no tokenizer here and decodes nothing."""
    from mii_async.config import HttpConfig
    from mii_async.gateway.openai_logprobs import PromptParts as _PromptParts
    from mii_async.gateway.state import GatewayState
    from mii_async.gateway.streams import Job, Opened
    from mii_async.outputs import Logprob, StreamChunk, TokenTexts

    s = GatewayState(None, HttpConfig())
    assert s.tokenizer is None
    ids = [1, 2, 3, 2, 1]
    texts = TokenTexts({i: f"t{i} " for i in (1, 2, 3, 9)})
    plps = [None] + [Logprob(t, -1.0, [(t, -1.0), (9, -2.0)], None, texts) for t in ids[1:]]
    first = StreamChunk("x", [4], None, None, None, None, plps, ids, texts)
    bare = StreamChunk("y", [4], None, None, None, None, None, ids)
    opened = [Opened(Job(j, 0, ids, {"prompt_logprobs": 2} if j == 0 else {}), first if j == 0 else bare, None)
              for j in range(4)]
    parts = _PromptParts(s, opened)
    echoes = [parts.echo(o.job, 2) for o in opened]
    vllms = [parts.vllm(o.job, 2) for o in opened]
    assert all(e is echoes[0] for e in echoes) and all(v is vllms[0] for v in vllms)
    assert echoes[0]["tokens"] == ["t1 ", "t2 ", "t3 ", "t2 ", "t1 "] and echoes[0]["token_logprobs"][1:] == [-1.0] * 4
    assert echoes[0]["top_logprobs"][1] == {"t2 ": -1.0, "t9 ": -2.0}
    assert vllms[0][1] == {"2": {"logprob": -1.0, "rank": 1, "decoded_token": "t2 "},
                           "9": {"logprob": -2.0, "rank": 2, "decoded_token": "t9 "}}


@pytest.fixture(scope="module")
def blind_gateway_url(start_gateway, tmp_path_factory):
    """A gateway whose own tokenizer is unavailable (--tokenizer names a directory that does not exist)."""
    return start_gateway(tokenizer=str(tmp_path_factory.mktemp("blind") / "no-tokenizer-here")).url


def test_logprob_texts_come_from_the_router_without_the_gateways_tokenizer(blind_gateway_url, model, deployment,
                                                                           default_model_dir):
    """Each logprob's token text rides on the router's Delta: a gateway without a tokenizer of its own shows
    the texts (and chat's bytes) of every token and top alternative as decode([id]) gives them, on chat,
    completions (the echoed prompt's tokens too, the first one's included) and vLLM's prompt_logprobs."""
    from transformers import AutoTokenizer

    from mii_async.text.token_bytes import TokenSpeller

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    speller = TokenSpeller.of(tok)
    [ref] = deployment([QUESTION], max_new_tokens=4, temperature=0, logprobs=2)
    r = httpx.post(f"{blind_gateway_url}/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "logprobs": True,
                         "top_logprobs": 2})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [tok.decode([i]) for i in ref.token_ids]
    assert [e["bytes"] for e in content] == [list(speller.spell(i)) for i in ref.token_ids]
    for e, lp in zip(content, ref.logprobs):
        assert [t["token"] for t in e["top_logprobs"]] == [tok.decode([i]) for i, _ in lp.top]
        assert [t["bytes"] for t in e["top_logprobs"]] == [list(speller.spell(i)) for i, _ in lp.top]
    ids = tok.encode("The capital of France is")
    [ref] = deployment([ids], max_new_tokens=2, temperature=0, logprobs=2, prompt_logprobs=2)
    r = httpx.post(f"{blind_gateway_url}/v1/completions", timeout=60,
                   json={"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2,
                         "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([i]) for i in ids + ref.token_ids]
    for top, x in zip(lp["top_logprobs"][1:], ref.prompt_logprobs[1:] + ref.logprobs):
        assert {tok.decode([i]) for i, _ in x.top} <= set(top)
    for entry, x in zip(choice["prompt_logprobs"][1:], ref.prompt_logprobs[1:]):
        assert {k: v["decoded_token"] for k, v in entry.items()} == {str(i): tok.decode([i])
                                                                      for i in [x.token_id] + [i for i, _ in x.top]}
    # the routes that need the gateway's own tokenizer say it has none (and the others above never asked)
    r = httpx.post(f"{blind_gateway_url}/tokenize", timeout=60, json={"model": model, "prompt": "Paris"})
    assert r.status_code == 503 and "no tokenizer" in r.text
