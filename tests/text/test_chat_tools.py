"""PromptEncoder with tools (the default model's real tokenizer, whose template ignores tools): a chat shows its
tools and history calls, anything else renders as before; malformed tools and calls are the caller's errors,
named; and the rule for keeping the call markers in an answer read for calls."""
from __future__ import annotations

import copy

import pytest

from mii_async.errors import InvalidParameterError
from mii_async.params import SamplingParams
from mii_async.text.chat_tools import (MAX_TOOLS, call_block, keep_call_markers, keeping_markers, render_chat,
                                       tool_section)
from mii_async.text.prompts import PromptEncoder

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def test_tools_and_history_calls_are_rendered_only_where_given(tokenizer):
    """A chat with tools shows them (here in our section: the template ignores them); one whose history holds
    calls shows those; a plain chat is the template's text, as without tool support."""
    enc = PromptEncoder(tokenizer)
    plain_text, plain_ids = enc.encode(ASK)
    assert plain_text == tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    text, ids = enc.encode(ASK, [WEATHER], parallel_tool_calls=False)
    assert tool_section([WEATHER], parallel=False) in text and text == render_chat(tokenizer, ASK, [WEATHER], False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"] and len(ids) > len(plain_ids)
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    text, _ = enc.encode(history)
    assert call_block("get_weather", {"city": "Paris"}) in text and "# Tools" not in text


@pytest.mark.parametrize("prompt, tools, param", [
    ("Weather in Paris?", [WEATHER], "tools"),                                     # tools go with a chat
    ([1, 2, 3], [WEATHER], "tools"),
    (ASK, [{"type": "function", "function": {"description": "no name"}}], "tools[0]"),
    (ASK, [WEATHER, {"type": "retrieval", "function": {"name": "f"}}], "tools[1]"),
    (ASK, [{"type": "function", "function": {"name": "f", "parameters": {1: "x"}}}], "tools[0]"),   # not JSON
    (ASK, [{"type": "function", "function": {"name": "f\ud800"}}], "tools[0].function.name"),
    (ASK, [WEATHER] * (MAX_TOOLS + 1), "tools"),
    (ASK, {"get_weather": WEATHER}, "tools"),
    (ASK + [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}], None,
     "messages[1].tool_calls[0]"),
    (ASK + [{"role": "assistant", "content": "", "tool_calls": "get_weather"}], None, "messages[1].tool_calls"),
])
def test_malformed_tools_and_calls_name_the_parameter(tokenizer, prompt, tools, param):
    with pytest.raises(InvalidParameterError) as err:
        PromptEncoder(tokenizer).encode(prompt, tools)
    assert err.value.param == param


def test_an_answer_read_for_calls_keeps_special_markers(tokenizer):
    """Markers are kept for a free-text answer to a chat with tools whose caller named no skip_special_tokens,
    and only where the tokenizer holds them as special tokens."""
    assert keep_call_markers([WEATHER], {"temperature": 0})
    assert not keep_call_markers(None, {}) and not keep_call_markers([], {})
    assert not keep_call_markers([WEATHER], {"skip_special_tokens": True})
    assert not keep_call_markers([WEATHER], {"guided_json": {"type": "object"}})
    special = copy.deepcopy(tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    params = SamplingParams(max_new_tokens=5)
    assert keeping_markers(params, special) == SamplingParams(max_new_tokens=5, skip_special_tokens=False)
    assert keeping_markers(params, tokenizer) is params
