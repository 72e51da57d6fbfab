"""Prompts of chats with tools (the default model's real tokenizer, and a copy given a template that knows
tools), and the checks of tools / tool_choice / tool-calling messages, without a server."""
from __future__ import annotations

import copy
import json

import pytest

from mii_async.gateway.http_errors import HTTPError
from mii_async.gateway.openai_params import chat_messages
from mii_async.gateway.tool_mode import ToolMode, tool_mode
from mii_async.gateway.tool_parser import parse_tool_calls
from mii_async.text.chat_tools import PROBE_TOOL, call_block, markers_are_special, render_chat, tool_section
from mii_async.text.prompts import PromptEncoder

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 22}'},
]
# Prints the tools, then each message with its calls (arguments must be objects: tojson of a dict) and results
KNOWING = ("{% if tools %}<TOOLS>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};"
           "{% endfor %}</TOOLS>\n{% endif %}{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}"
           "{% for c in m.tool_calls %}CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}"
           "{% endfor %}{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }} {{ m.content }}{% else %}"
           "{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def _render(tokenizer, messages, mode: ToolMode | None, **kw) -> str:
    """The prompt the router renders for a chat under `mode` (the tools it shows, whether calls may be several)."""
    return render_chat(tokenizer, messages, mode.shown if mode else None, mode.parallel if mode else True, **kw)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def knowing(tokenizer):
    t = copy.deepcopy(tokenizer)
    t.chat_template = KNOWING
    return t


def test_a_template_that_ignores_tools_gets_the_fallback_section(tokenizer):
    """SmolLM2's template prints role and content only: the tools and the way to call them go into a system
    message of ours (replacing the template's default one), the rest as the template renders it."""
    messages = chat_messages([{"role": "user", "content": "Weather in Paris?"}])
    mode = tool_mode([WEATHER], None, None)
    assert tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False) == \
        tokenizer.apply_chat_template(messages, tokenize=False)            # it does ignore them
    text = _render(tokenizer, messages, mode)
    section = tool_section([WEATHER], parallel=True)
    assert text == tokenizer.apply_chat_template([{"role": "system", "content": section}] + messages,
                                                 add_generation_prompt=True, tokenize=False)
    assert json.dumps(WEATHER) in section and "<tool_call>" in section and "You are a helpful" not in text
    with_system = chat_messages([{"role": "system", "content": "Be brief."}] + messages)
    assert f"Be brief.\n\n{section}" in _render(tokenizer, with_system, mode)
    assert "at most one call" in _render(tokenizer, messages, tool_mode([WEATHER], None, False))
    assert _render(tokenizer, messages, tool_mode([WEATHER], "none", None)) == \
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)   # none: no tools
    ids = PromptEncoder(tokenizer).encode(messages, mode.shown, mode.parallel)[1]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"] and tokenizer.decode(ids) == text


def test_history_calls_and_results_show_in_a_role_content_template(tokenizer):
    """An earlier call is written as a <tool_call> block (which the answer parser reads back), the results as a
    user turn of <tool_response> blocks, consecutive ones together."""
    messages = chat_messages(HISTORY + [{"role": "tool", "tool_call_id": "call_2", "content": "rain"}])
    text = _render(tokenizer, messages, tool_mode([WEATHER], None, None))
    block = call_block("get_weather", {"city": "Paris"})
    assert f"<|im_start|>assistant\n{block}<|im_end|>" in text
    assert parse_tool_calls(block, frozenset({"get_weather"}))[1][0].arguments == '{"city": "Paris"}'
    assert ("<|im_start|>user\n<tool_response>\n{\"celsius\": 22}\n</tool_response>\n"
            "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    no_tools = _render(tokenizer, messages, None)           # a follow-up that gives no tools
    assert block in no_tools and "<tools>" not in no_tools and "<tool_response>\nrain" in no_tools


def test_a_template_that_knows_tools_gets_them_natively(knowing):
    """A template that prints tools gets the tools and the history as Hugging Face's templates take them:
    calls with id and arguments as an object, tool results with their tool_call_id; no section of ours."""
    messages = chat_messages(HISTORY)
    text = _render(knowing, messages, tool_mode([WEATHER], None, None))
    params = json.dumps(WEATHER["function"]["parameters"])
    assert text == (f"<TOOLS>get_weather:{params};</TOOLS>\n[user]Weather in Paris?\n"
                    "[assistant]CALL call_1 get_weather Paris\n[tool]RESULT call_1 {\"celsius\": 22}\n[assistant]")
    assert "<tool_call>" not in text and "# Tools" not in text
    none = _render(knowing, messages, tool_mode([WEATHER], "none", None))
    assert none == text.split("\n", 1)[1]                       # tool_choice none: no tools, history native


def test_a_template_that_refuses_tools_gets_the_fallback(knowing):
    t = copy.deepcopy(knowing)
    t.chat_template = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + \
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    text = _render(t, chat_messages(HISTORY), tool_mode([WEATHER, PROBE_TOOL], None, None))
    assert text.startswith("system: # Tools") and "<tool_call>" in text


def test_special_markers_are_seen(tokenizer):
    """A tokenizer that holds <tool_call> as a special token would lose it to skip_special_tokens: auto then
    keeps special tokens in the answer."""
    t = copy.deepcopy(tokenizer)
    t.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    assert markers_are_special(t) and not markers_are_special(tokenizer)
    ids = t("<tool_call>{}</tool_call>", add_special_tokens=False)["input_ids"]
    assert t.decode(ids, skip_special_tokens=True) == "{}"


def test_a_template_error_names_messages(knowing):
    t = copy.deepcopy(knowing)
    t.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(Exception) as e:
        _render(t, chat_messages(HISTORY), None)
    assert e.value.param == "messages" and "roles must alternate" in str(e.value)


def _param(fn, *args) -> str:
    with pytest.raises(HTTPError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value.param


def _fn(**kw):
    return {"type": "function", "function": {"name": "f", **kw}}


@pytest.mark.parametrize("tools, choice, param", [
    ([_fn(name="get weather")], None, "tools[0].function.name"),            # OpenAI's name pattern
    ([_fn(name="x" * 65)], None, "tools[0].function.name"),
    ([_fn(name="")], None, "tools[0].function.name"),
    ([_fn(), _fn()], None, "tools[1].function.name"),                       # twice
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    (["f"], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "f"}, "x": 1}], None, "tools[0].x"),
    ([_fn(examples=[])], None, "tools[0].function.examples"),
    ([_fn(parameters={"type": "no-such-type"})], None, "tools[0].function.parameters"),   # the compiler refuses
    ([_fn(parameters="{}")], None, "tools[0].function.parameters"),
    ([_fn(description=3)], None, "tools[0].function.description"),
    ([_fn(strict="yes")], None, "tools[0].function.strict"),
    ([_fn()] * 129, None, "tools"),
    ([_fn()], "sometimes", "tool_choice"),
    ([_fn()], {"type": "function"}, "tool_choice"),
    ([_fn()], {"type": "function", "function": {"name": "g"}}, "tool_choice.function.name"),
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "f"}}, "tool_choice"),
])
def test_bad_tools_name_the_parameter(tools, choice, param):
    assert _param(tool_mode, tools, choice, None) == param


def test_modes_and_their_guides():
    """required guides into an array of 1+ calls (≤ 1 without parallel calls) of the given names with their
    schemas; named into that tool's arguments; none and auto are free; no tools is no mode."""
    a, b = _fn(parameters={"type": "object", "properties": {"x": {"type": "integer"}}}), _fn(name="g")
    assert tool_mode(None, None, None) is None and tool_mode([], "auto", None) is None
    assert tool_mode(None, "none", None) is None
    auto = tool_mode([a, b], None, None)
    assert (auto.choice, auto.parallel, auto.names, auto.guided_json()) == ("auto", True, {"f", "g"}, None)
    req = tool_mode([a, b], "required", False).guided_json()
    assert req["type"] == "array" and (req["minItems"], req["maxItems"]) == (1, 1)
    assert [c["properties"]["name"] for c in req["items"]["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert req["items"]["anyOf"][0]["properties"]["arguments"] == a["function"]["parameters"]
    assert req["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert "maxItems" not in tool_mode([a], "required", None).guided_json()
    named = tool_mode([a, b], {"type": "function", "function": {"name": "f"}}, None)
    assert (named.choice, named.name, named.guided_json()) == ("named", "f", a["function"]["parameters"])


def test_outlines_core_takes_the_required_schema():
    """The constructs the required guide uses compile in outlines-core and mean what they say: const names,
    anyOf over the tools, minItems 1, maxItems 1 without parallel calls."""
    import re

    from mii_async.guided import normalize_json_schema, schema_regex

    a = _fn(parameters={"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    tools = [a, _fn(name="g")]

    def admits(parallel, text):
        schema = tool_mode(tools, "required", parallel).guided_json()
        return re.fullmatch(schema_regex(normalize_json_schema(schema)), text) is not None

    one, two = '[{"name":"f","arguments":{"x":1}}]', '[{"name":"f","arguments":{"x":1}},{"name":"g","arguments":{}}]'
    assert admits(True, one) and admits(True, two) and admits(False, one) and not admits(False, two)
    assert not admits(True, "[]") and not admits(True, '[{"name":"h","arguments":{}}]')
    assert not admits(True, '[{"name":"f","arguments":{"x":"1"}}]') and not admits(True, '[{"name":"g","arguments":{"x":1}}]')


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": {"a": 1}}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": ["f"]}], "messages[0].tool_calls[0]"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}], "messages[0].tool_calls[0].type"),
    ([{"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "f"}}]}], "messages[0].tool_calls[0].id"),
    ([{"role": "tool", "content": "r", "tool_call_id": 5}], "messages[0].tool_call_id"),
    ([{"role": "tool", "content": None, "tool_call_id": "c"}], "messages[0].content"),
])
def test_bad_tool_messages_name_the_parameter(messages, param):
    assert _param(chat_messages, messages) == param


def test_tool_messages_keep_what_templates_need():
    """Calls keep id, type and name, arguments decoded when JSON (kept as text when not); tool results keep
    tool_call_id and name; other messages stay {"role", "content"}."""
    got = chat_messages([{"role": "developer", "content": "s", "name": "boss"}] + HISTORY + [
        {"role": "assistant", "content": "ok", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "r"}], "tool_call_id": "c", "name": "f"}])
    assert got[0] == {"role": "system", "content": "s"} and got[1] == HISTORY[0]
    assert got[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert got[3] == {"role": "tool", "content": '{"celsius": 22}', "tool_call_id": "call_1"}
    assert got[4]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert got[5] == {"role": "tool", "content": "r", "tool_call_id": "c", "name": "f"}
