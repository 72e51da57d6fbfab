"""Tool calling through the official `openai` package, unmodified, against a real gateway of the default model
(SmolLM2-135M, whose chat template ignores tools: the fallback section the router renders shows them)."""
from __future__ import annotations

import json

import httpx
import pytest

from mii_async.text.chat_tools import call_block

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _history(cities: list[str]) -> list[dict]:
    """Earlier turns in which the assistant called get_weather: the small model then writes such a call too."""
    out: list[dict] = []
    for i, city in enumerate(cities):
        out += [{"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": '{"celsius": 20}'},
                {"role": "assistant", "content": f"It is 20 degrees in {city}."}]
    return out + [{"role": "user", "content": "What is the weather in Paris?"}]


def _matches(value, schema: dict) -> bool:
    """The JSON-schema checks the tools above use: object, required, properties, string maxLength, enum, integer."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        return isinstance(value, dict) and set(schema.get("required", [])) <= set(value) and \
            set(value) <= set(schema["properties"]) and \
            all(_matches(v, schema["properties"][k]) for k, v in value.items())
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    raise AssertionError(f"no check for {schema}")


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _check_calls(message, one: bool) -> None:
    assert message.tool_calls and (len(message.tool_calls) == 1 if one else True)
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in SCHEMAS
        assert _matches(json.loads(c.function.arguments), SCHEMAS[c.function.name]), c.function.arguments


def _streamed(oai, **kw):
    with oai.chat.completions.stream(**kw, stream_options={"include_usage": True}) as s:
        return s.get_final_completion()


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_are_given_tools_with_arguments_in_their_schemas(oai, model, parallel):
    """tool_choice required: the answer is the calls (one without parallel_tool_calls), each naming a given tool
    with arguments its schema admits, finish_reason tool_calls; streamed and put together by the openai
    package's stream helper, the same calls and token counts."""
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
              temperature=0, max_tokens=120)
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message, one=not parallel)
    s = _streamed(oai, **kw)
    assert s.choices[0].finish_reason == "tool_calls" and _calls(s.choices[0].message) == _calls(choice.message)
    assert (s.usage.prompt_tokens, s.usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)


def test_a_named_function_is_called_with_its_arguments(oai, model, gateway_url):
    """tool_choice naming a function: one call of it, arguments in its schema, finish_reason "stop" (as OpenAI
    answers a forced named call); streamed, the first delta has the id, type, name and arguments "", then the
    arguments come in pieces that add up to the plain answer's."""
    kw = dict(model=model, messages=[{"role": "user", "content": "What is 20 plus 22?"}], tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0, max_tokens=40)
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls[0].function.name == "add"
    _check_calls(r.choices[0].message, one=True)
    chunks = [c for c in oai.chat.completions.create(**kw, stream=True) if c.choices]
    parts = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert parts[0].id.startswith("call_") and parts[0].type == "function"
    assert (parts[0].function.name, parts[0].function.arguments) == ("add", "")
    assert len(parts) > 3 and all(p.index == 0 and p.id is None and p.function.name is None for p in parts[1:])
    assert "".join(p.function.arguments for p in parts) == r.choices[0].message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    assert _calls(_streamed(oai, **kw).choices[0].message) == _calls(r.choices[0].message)


def test_auto_reads_the_call_the_model_writes(oai, model):
    """tool_choice auto (the default): after three turns that called get_weather, the model writes a <tool_call>
    block for Paris; it comes back as a call, with no content, streamed too (no piece of the block leaks into
    the content). With tool_choice none the same answer stays text, and its prompt shows no tools."""
    kw = dict(model=model, messages=_history(["London", "Rome", "Berlin"]), tools=TOOLS, temperature=0, max_tokens=60)
    r = oai.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None
    [(name, args)] = _calls(m)
    assert name == "get_weather" and json.loads(args)["city"] == "Paris"
    chunks = [c for c in oai.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    [part] = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert (part.function.name, part.function.arguments) == (name, args) and part.id.startswith("call_")
    none = oai.chat.completions.create(**kw, tool_choice="none")
    assert none.choices[0].finish_reason == "stop" and none.choices[0].message.tool_calls is None
    assert "<tool_call>" in none.choices[0].message.content and "Paris" in none.choices[0].message.content
    assert none.usage.prompt_tokens < r.usage.prompt_tokens


def test_auto_without_a_call_is_plain_text(oai, model):
    """An answer that calls nothing is the content as written, finish_reason stop, streamed alike."""
    kw = dict(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=30)
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    streamed = [c for c in oai.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_the_prompt_shows_the_tools_and_counts_right(oai, model, gateway_url):
    """The prompt the engine runs is the one /tokenize gives for the messages and tools (usage counts it): the
    template ignores tools, so the gateway's section lists them; tool_choice none runs the plain chat's."""
    r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1)
    tok = httpx.post(f"{gateway_url}/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=60).json()
    assert r.usage.prompt_tokens == tok["count"]
    text = httpx.post(f"{gateway_url}/detokenize", json={"tokens": tok["tokens"]}, timeout=60).json()["prompt"]
    assert json.dumps(WEATHER) in text and json.dumps(ADD) in text and "<tool_call>" in text
    plain = httpx.post(f"{gateway_url}/tokenize", json={"messages": ASK}, timeout=60).json()
    none = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens == plain["count"] < tok["count"]


def test_the_openai_flow_round_trip(oai, model, gateway_url):
    """The usual loop: the assistant's message (the package's own object) and the tool's result go back in the
    history; the next answer runs on a prompt holding both (counted as /tokenize counts it)."""
    messages = list(ASK)
    r = oai.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_tokens=60)
    call = r.choices[0].message.tool_calls[0]
    messages += [r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    again = oai.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=20)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    sent = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    tok = httpx.post(f"{gateway_url}/tokenize", json={"messages": sent, "tools": TOOLS}, timeout=60).json()
    assert again.usage.prompt_tokens == tok["count"]
    text = httpx.post(f"{gateway_url}/detokenize", json={"tokens": tok["tokens"]}, timeout=60).json()["prompt"]
    assert call_block(call.function.name, json.loads(call.function.arguments)) in text
    assert "<tool_response>\n{\"celsius\": 21}\n</tool_response>" in text


def _sse(url: str, body: dict) -> list[dict]:
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_n_choices_are_each_parsed(model, gateway_url):
    """Streamed with n = 2, each choice's calls come with its own index, ids and arguments, and each ends
    with tool_calls; the usage chunk counts both."""
    events = _sse(gateway_url, {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                "n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 120, "stream": True,
                                "stream_options": {"include_usage": True}})
    for index in (0, 1):
        deltas = [c["delta"] for e in events for c in e["choices"] if c["index"] == index]
        ends = [c["finish_reason"] for e in events for c in e["choices"] if c["index"] == index and c["finish_reason"]]
        calls: dict[int, dict] = {}
        for d in deltas:
            for t in d.get("tool_calls", []):
                cur = calls.setdefault(t["index"], {"name": "", "arguments": "", "ids": 0})
                cur["ids"] += "id" in t
                cur["name"] += t["function"].get("name", "")
                cur["arguments"] += t["function"]["arguments"]
        assert ends == ["tool_calls"] and calls and all(c["ids"] == 1 for c in calls.values())
        for c in calls.values():
            assert _matches(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0


def test_a_call_cut_by_max_tokens_is_text(oai, model):
    """Out of tokens in the middle of the calls: finish_reason length, the JSON so far as content (as vLLM)."""
    r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                    temperature=0, max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("[")


BAD_CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                  "function": {"name": "add", "arguments": 5}}]}


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [ADD, ADD]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"tools": {"add": ADD}}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "guided_json": {"type": "object"}}, "guided_json"),
    ({"tools": TOOLS, "guided_choice": ["a", "b"]}, "guided_choice"),
    ({"functions": [ADD["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": ASK + [BAD_CALL]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": 1, "content": "r"}]}, "messages[1].tool_call_id"),
])
def test_refusals_name_the_parameter(model, gateway_url, extra, param):
    body = {"model": model, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
