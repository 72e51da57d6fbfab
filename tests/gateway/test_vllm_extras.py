"""vLLM's request extras and OpenAI's labelling fields through a real gateway (the default model, and a copy of
it whose chat template reads template variables and whose tokenizer adds a BOS token), the render options in
the encoder itself, and a stream cut by max_tokens inside a character."""
from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from mii_async.errors import InvalidParameterError
from mii_async.text.prompts import PromptEncoder
from mii_async.text.render_options import RenderOptions

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# A chat template that shows the variables vLLM hands it (chat_template_kwargs, reasoning_effort, verbosity)
TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n"
            "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
            "{%- if reasoning_effort is defined %}effort={{ reasoning_effort }} {% endif %}"
            "{%- if verbosity is defined %}verbosity={{ verbosity }} {% endif %}{% endif %}")


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=120)


def _prompt_ids(answer: dict) -> list[int]:
    """The prompt's ids after the first, from vLLM's prompt_logprobs (each entry's first key is the token)."""
    return [int(next(iter(e))) for e in answer["prompt_logprobs"][1:]]


@pytest.fixture(scope="module")
def templated(tmp_path_factory, default_model_dir):
    """(gateway URL, tokenizer) of a deployment of the default model with TEMPLATE as its chat template and a
    tokenizer that adds <|endoftext|> (id 0) before a text when asked for special tokens."""
    import mii_async
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    from tests.mesh_helpers import deployment_pids, wait_gone

    d = tmp_path_factory.mktemp("templated")
    for name in os.listdir(default_model_dir):
        if name not in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
            os.symlink(default_model_dir / name, d / name)
    shutil.copy(default_model_dir / "tokenizer_config.json", d / "tokenizer_config.json")
    (d / "chat_template.jinja").write_text(TEMPLATE)
    tk = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    tk.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                      special_tokens=[("<|endoftext|>", 0)])
    tk.save(str(d / "tokenizer.json"))
    client = mii_async.serve(str(d), kv_cache_memory=0.1, enable_http=True, http_port=0)
    pids = [client._process.pid] + deployment_pids(client.run(client.health()))
    yield client.http_url, AutoTokenizer.from_pretrained(str(d))
    client.terminate_server_sync(drain_s=0)
    assert not wait_gone(pids), "processes left behind"


def test_template_variables_reach_the_chat_template(templated):
    """chat_template_kwargs, reasoning_effort and verbosity are the template's variables (the caller's own
    kwargs over the other two): the prompt's ids are the template's rendering with them."""
    url, tok = templated
    r = _post(url, "chat/completions", {"messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 0,
                                        "reasoning_effort": "low", "verbosity": "high",
                                        "chat_template_kwargs": {"enable_thinking": False, "verbosity": "low"}})
    assert r.status_code == 200, r.text
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False, enable_thinking=False,
                                   reasoning_effort="low", verbosity="low")
    assert text.endswith("assistant<think></think>effort=low verbosity=low ")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert _prompt_ids(r.json()) == ids[1:] and r.json()["usage"]["prompt_tokens"] == len(ids)
    for body, param in (({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
                        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
                        ({"verbosity": 3}, "verbosity")):
        r = _post(url, "chat/completions", {"messages": QUESTION, "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_add_special_tokens(templated):
    """add_special_tokens: a text gets the tokenizer's special tokens unless false; a chat only when true."""
    url, tok = templated
    counts = {}
    for route, key, prompt in (("completions", "prompt", "Hello there"), ("chat/completions", "messages", QUESTION)):
        for flag in (None, True, False):
            body = {key: prompt, "max_tokens": 1} | ({} if flag is None else {"add_special_tokens": flag})
            r = _post(url, route, body)
            assert r.status_code == 200, r.text
            counts[route, flag] = r.json()["usage"]["prompt_tokens"]
    plain = len(tok("Hello there", add_special_tokens=False)["input_ids"])
    assert counts["completions", None] == counts["completions", True] == plain + 1
    assert counts["completions", False] == plain
    assert counts["chat/completions", None] == counts["chat/completions", False] == counts["chat/completions", True] - 1


def test_add_generation_prompt_continue_final_message_and_chat_echo(gateway_url, default_model_dir):
    """add_generation_prompt false leaves the assistant's turn unopened; continue_final_message ends the prompt
    inside the last message, and echo starts the answer with that message's text (streamed too)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    partial = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    for extra, hf in (({"add_generation_prompt": False}, {"add_generation_prompt": False}),
                      ({"add_generation_prompt": False, "continue_final_message": True},
                       {"continue_final_message": True})):
        msgs = QUESTION if "continue_final_message" not in extra else partial
        r = _post(gateway_url, "chat/completions", {"messages": msgs, "max_tokens": 1, "prompt_logprobs": 0, **extra})
        assert r.status_code == 200, r.text
        assert _prompt_ids(r.json()) == tok.apply_chat_template(msgs, tokenize=True, **hf)["input_ids"][1:]
    body = {"messages": partial, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True}
    whole = _post(gateway_url, "chat/completions", body).json()["choices"][0]["message"]["content"]
    plain = _post(gateway_url, "chat/completions", {**body, "echo": False}).json()["choices"][0]["message"]["content"]
    assert whole == "The capital of France is" + plain and " Paris" in plain
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == whole
    r = _post(gateway_url, "chat/completions", {"messages": partial, "max_tokens": 1, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_truncate_prompt_tokens(gateway_url, default_model_dir):
    """truncate_prompt_tokens keeps the prompt's last tokens (the echo shows them), on both routes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompt = "one two three four five six seven"
    r = _post(gateway_url, "completions", {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 3,
                                           "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    kept = tok(prompt)["input_ids"][-3:]
    assert r.json()["usage"]["prompt_tokens"] == 3 and r.json()["choices"][0]["text"].startswith(tok.decode(kept))
    r = _post(gateway_url, "chat/completions", {"messages": QUESTION, "max_tokens": 1, "truncate_prompt_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5, r.text
    r = _post(gateway_url, "completions", {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_allowed_token_ids_and_tokens_as_ids(gateway_url, default_model_dir):
    """Only allowed_token_ids are sampled; return_tokens_as_token_ids shows logprobs' tokens as token_id:N on
    both routes (the top alternatives too); an id outside the vocabulary is a 400 naming the field."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    allowed = sorted({tok(" yes")["input_ids"][0], tok(" no")["input_ids"][0], tok(" maybe")["input_ids"][0]})
    r = _post(gateway_url, "completions", {"prompt": "Is it true?", "max_tokens": 6, "temperature": 1.0, "seed": 3,
                                           "allowed_token_ids": allowed, "logprobs": 2,
                                           "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and {int(t.removeprefix("token_id:")) for t in lp["tokens"]} <= set(allowed)
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    r = _post(gateway_url, "chat/completions", {"messages": QUESTION, "max_tokens": 3, "allowed_token_ids": allowed,
                                                "logprobs": True, "top_logprobs": 1,
                                                "return_tokens_as_token_ids": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert all(int(c["token"].removeprefix("token_id:")) in allowed for c in content)
    assert all(bytes(c["bytes"]) == c["token"].encode() for c in content)
    r = _post(gateway_url, "completions", {"prompt": "x", "max_tokens": 1, "allowed_token_ids": [10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_structured_outputs_and_completions_response_format(gateway_url):
    """structured_outputs (choice, regex, json_object) guide as the guided_* fields do; completions take
    response_format; a grammar, or two guides at once, is a 400 naming the field."""
    for so, check in (({"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                      ({"regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
                      ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))):
        r = _post(gateway_url, "chat/completions", {"messages": QUESTION, "max_tokens": 40, "temperature": 0,
                                                    "structured_outputs": so})
        assert r.status_code == 200 and check(r.json()["choices"][0]["message"]["content"]), (so, r.text)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    r = _post(gateway_url, "completions", {"prompt": "The capital of France as JSON:", "max_tokens": 30,
                                           "temperature": 0, "response_format": {"type": "json_schema",
                                                                                 "json_schema": {"name": "c",
                                                                                                 "schema": schema}}})
    assert r.status_code == 200 and "city" in json.loads(r.json()["choices"][0]["text"]), r.text
    for body, param in (({"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs.grammar"),
                        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
                        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "structured_outputs"),
                        ({"guided_grammar": "root ::= \"a\""}, "guided_grammar")):
        r = _post(gateway_url, "completions", {"prompt": "x", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_with_max_tokens_zero_scores_the_prompt(gateway_url):
    """echo with max_tokens 0 answers the prompt alone, with its logprobs (the first null), finish_reason
    length and no completion tokens; streamed, the same text and logprobs."""
    body = {"prompt": "The capital of France is Paris", "max_tokens": 0, "echo": True, "logprobs": 1}
    r = _post(gateway_url, "completions", body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["text"] == body["prompt"] and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"]
    values = choice["logprobs"]["token_logprobs"]
    assert values[0] is None and all(v <= 0 for v in values[1:])
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == body["prompt"]
    assert events[0]["choices"][0]["logprobs"]["tokens"] == choice["logprobs"]["tokens"]
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    r = _post(gateway_url, "completions", {"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_labels_are_accepted_and_change_nothing(gateway_url):
    """prompt_cache_key, safety_identifier, store false, service_tier, user and metadata are taken and leave the
    answer as it was; store true (nothing is stored on these routes) is a 400 naming it."""
    body = {"messages": QUESTION, "max_tokens": 6, "temperature": 0}
    plain = _post(gateway_url, "chat/completions", body).json()["choices"][0]["message"]["content"]
    labels = {"prompt_cache_key": "k1", "safety_identifier": "u-42", "store": False, "service_tier": "flex",
              "user": "someone", "metadata": {"team": "a"}}
    for route, extra in (("chat/completions", {}), ("completions", {"prompt": "Hi"})):
        r = _post(gateway_url, route, {**body, **labels} if not extra else {"max_tokens": 2, **extra, **labels})
        assert r.status_code == 200, r.text
    labelled = _post(gateway_url, "chat/completions", {**body, **labels}).json()
    assert labelled["choices"][0]["message"]["content"] == plain
    for field, value in (("store", True), ("service_tier", "gold")):
        r = _post(gateway_url, "chat/completions", {**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_priority_is_taken_on_both_routes_and_checked(gateway_url):
    """vLLM's `priority` (an integer; the scheduler's order among waiting requests) is accepted on both routes
    and leaves a lone request's answer as it was; a string or a float is a 400 naming it."""
    body = {"messages": QUESTION, "max_tokens": 6, "temperature": 0}
    plain = _post(gateway_url, "chat/completions", body).json()["choices"][0]["message"]["content"]
    first = _post(gateway_url, "chat/completions", {**body, "priority": -3})
    assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"] == plain, first.text
    r = _post(gateway_url, "completions", {"prompt": "Hi", "max_tokens": 2, "priority": 7})
    assert r.status_code == 200, r.text
    for bad in ("5", 1.5, True):
        r = _post(gateway_url, "chat/completions", {**body, "priority": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", (bad, r.text)


def test_unknown_fields_refused_unless_lenient(gateway_url, start_gateway, capfd):
    """An unknown field is a 400 naming it; a gateway with lenient_requests takes the request, logging a
    warning once per field name."""
    body = {"messages": QUESTION, "max_tokens": 2, "frobnicate": 1}
    r = _post(gateway_url, "chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate", r.text
    lenient = start_gateway(lenient_requests=True).url
    capfd.readouterr()
    for route, extra in (("chat/completions", {}), ("completions", {"prompt": "Hi"}), ("chat/completions", {})):
        r = _post(lenient, route, {**body, **extra} if not extra else {"max_tokens": 2, "frobnicate": 1, **extra})
        assert r.status_code == 200, r.text
    assert capfd.readouterr().err.count("ignoring the unknown request field 'frobnicate'") == 1


def test_a_stream_cut_inside_a_character_ends_without_a_replacement_char(gateway_url, deployment, default_model_dir):
    """max_tokens cutting a character in the middle (its first token forced): the stream and the answer end
    without U+FFFD, the client's generated_text agrees, and the token still counts in the usage."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    head = next(i for i in tok("你好世界", add_special_tokens=False)["input_ids"] if tok.decode([i]) == "\ufffd")
    body = {"prompt": "Say hello in Chinese:", "max_tokens": 1, "allowed_token_ids": [head]}
    r = _post(gateway_url, "completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "" and r.json()["usage"]["completion_tokens"] == 1
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == ""
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    [answer] = deployment(["Say hello in Chinese:"], max_new_tokens=1, allowed_token_ids=[head])
    assert answer.generated_text == "" and answer.token_ids == [head]


def test_render_options_in_the_encoder():
    """The encoder applies the options: special tokens, truncation to the last tokens (the text as they decode),
    and chat-only options refused for a text; the options name a bad field."""
    from tokenizers import processors

    from tests.text.spm_tokenizers import spm_tokenizer

    tok = spm_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    enc = PromptEncoder(tok)
    text, ids = enc.encode("Hello world, this is the end")
    assert ids[0] == 1                                                   # <s>
    assert enc.encode("Hello world, this is the end", options=RenderOptions(add_special_tokens=False))[1] == ids[1:]
    text, kept = enc.encode("Hello world, this is the end", options=RenderOptions(truncate_prompt_tokens=3))
    assert kept == ids[-3:] and text == enc.tokenizer.decode(kept)
    assert enc.encode([5, 6, 7, 8], options=RenderOptions(truncate_prompt_tokens=2)) == (None, [7, 8])
    for options, param in ((RenderOptions(add_generation_prompt=False), "add_generation_prompt"),
                           (RenderOptions(chat_template_kwargs={"x": 1}), "chat_template_kwargs")):
        with pytest.raises(InvalidParameterError) as e:
            enc.encode("a text", options=options)
        assert e.value.param == param
    for fields, param in (({"continue_final_message": True}, "continue_final_message"),
                          ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
                          ({"chat_template_kwargs": {"x": float("nan")}}, "chat_template_kwargs"),
                          ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
                          ({"add_special_tokens": "yes"}, "add_special_tokens")):
        with pytest.raises(InvalidParameterError) as e:
            RenderOptions(**fields)
        assert e.value.param == param, fields
    with pytest.raises(InvalidParameterError) as e:
        RenderOptions.coerce({"add_bos": True})
    assert e.value.param == "render.add_bos"


def test_the_client_and_the_local_pipeline_render_alike(gateway_url, deployment, default_pipe):
    """`render=` on AsyncClient and on pipeline() carries the same options as the gateway's fields: the same
    prompt ids for a continued message, and truncation to the last tokens."""
    partial = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    r = _post(gateway_url, "chat/completions", {"messages": partial, "max_tokens": 2, "temperature": 0,
                                                "prompt_logprobs": 0, **options})
    [mesh] = deployment([partial], max_new_tokens=2, render=options)
    [local] = default_pipe([partial], max_new_tokens=2, render=RenderOptions(**options))
    assert mesh.prompt_token_ids == local.prompt_token_ids and mesh.prompt_token_ids[1:] == _prompt_ids(r.json())
    assert mesh.generated_text == local.generated_text == r.json()["choices"][0]["message"]["content"]
    for run in (deployment, default_pipe):
        [answer] = run(["one two three four five"], max_new_tokens=1, render={"truncate_prompt_tokens": 2})
        assert answer.prompt_length == 2
