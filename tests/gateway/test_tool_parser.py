"""Reading tool calls out of answers, without a server: tool_choice auto's text parser (whole and streamed, with
its hold-back), the guided array reader of tool_choice required, and a choice's message and stream deltas."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mii_async.gateway.call_array import Arguments, CallArrayReader, Named
from mii_async.gateway.tool_answer import ToolDeltas, stream_choices, tool_message
from mii_async.gateway.tool_mode import tool_mode
from mii_async.gateway.tool_parser import OPEN, Call, ToolCallParser, parse_tool_calls

NAMES = frozenset({"get_weather", "add"})
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
A = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
WC, AC = Call("get_weather", '{"city": "Paris"}'), Call("add", '{"a": 1, "b": 2}')


@pytest.mark.parametrize("text, content, calls", [
    ("Paris is sunny.", "Paris is sunny.", []),                                   # no call: the text as written
    ("  spaced out \n", "  spaced out \n", []),
    ("", "", []),
    (f"<tool_call>\n{W}\n</tool_call>", None, [WC]),                              # one block, Hermes layout
    (f"<tool_call>{W}</tool_call>", None, [WC]),
    (f"Let me look.\n<tool_call>{W}</tool_call>", "Let me look.", [WC]),          # text before
    (f"<tool_call>{W}</tool_call>\nThat is all.", "That is all.", [WC]),          # text after
    (f"Sure.\n<tool_call>{W}</tool_call>\n<tool_call>{A}</tool_call>\nDone.", "Sure.\nDone.", [WC, AC]),  # several
    (f"<tool_call>{W}</tool_call><tool_call>{A}</tool_call>", None, [WC, AC]),
    (f"<tool_call>{W}", None, [WC]),                                              # unclosed at the end: read
    ('<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call>', None, [AC]),   # Llama's key
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [AC]),              # a whole answer of JSON
    (f"\n {W} \n", None, [WC]),
    ('{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}', None,           # arguments as JSON text
     [Call("add", '{"a": 1, "b": 2}')]),
    ('<tool_call>{"name": "add"}</tool_call>', None, [Call("add", "{}")]),       # no arguments: {}
])
def test_calls_and_content(text, content, calls):
    """Blocks and whole-answer JSON become calls; the text outside them is the content (None when only
    whitespace is left), and an answer without calls is given back exactly."""
    assert parse_tool_calls(text, NAMES) == (content, calls)


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',      # not a given tool
    "<tool_call>{not json}</tool_call>",                                           # malformed
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',                 # arguments not an object
    '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>',
    '<tool_call>["add"]</tool_call>',
    '{"name": "add", "arguments": {"a": 1}} and then some text',                   # JSON with text after it
    '{"name": "nobody", "arguments": {}}',
    '{"city": "Paris"}',
    "x < y and a <tool_ b",                                                        # marker prefixes in text
    "<tool_call",
])
def test_what_is_not_a_call_stays_content(text):
    """Unknown names, unparsable JSON, arguments that are no object: the answer is plain content, as written."""
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_a_bad_block_stays_beside_good_ones():
    text = f"<tool_call>{{broken</tool_call>\n<tool_call>{A}</tool_call>"
    assert parse_tool_calls(text, NAMES) == ("<tool_call>{broken</tool_call>", [AC])


def test_without_parallel_calls_only_the_first_is_kept():
    text = f"<tool_call>{W}</tool_call>\n<tool_call>{A}</tool_call>"
    assert parse_tool_calls(text, NAMES, parallel=False) == (None, [WC])


def _stream(pieces: list[str], cut: bool = False) -> list[str | Call]:
    p = ToolCallParser(NAMES)
    out: list[str | Call] = []
    for piece in pieces:
        out += p.feed(piece)
    return out + p.finish(cut=cut)


def test_streamed_content_goes_out_at_once_and_marker_prefixes_wait():
    """Text goes out as it comes (less trailing whitespace); a tail that may start `<tool_call>` waits and goes
    out as content once it cannot; a block goes out as one call when it closes."""
    p = ToolCallParser(NAMES)
    assert p.feed("Hello world") == ["Hello world"]
    assert p.feed(" and ") == [" and"]                 # the trailing space waits
    assert p.feed("<tool") == []                       # may be a marker
    assert p.feed("s are nice") == [" <tools are nice"]
    assert p.feed(" <tool_") == []
    assert p.feed("call>{\"name\": \"add\", ") == []
    assert p.feed('"arguments": {"a": 1, "b": 2}}</tool_') == []
    assert p.feed("call>") == [AC]
    assert p.finish() == []


def test_a_whole_json_answer_waits_for_its_end():
    """An answer that starts as a JSON object is held: a call if it is one with nothing after it, content
    (all of it, at once) as soon as it is not."""
    p = ToolCallParser(NAMES)
    assert p.feed('{"name": "add", ') == [] and p.feed('"arguments": {"a": 1, "b": 2}}') == []
    assert p.finish() == [AC]
    p = ToolCallParser(NAMES)
    assert p.feed('{"name": "add", "arguments": {}}') == [] and p.feed(" so") == ['{"name": "add", "arguments": {}} so']
    p = ToolCallParser(NAMES)
    assert p.feed('{"answer": 42}') == ['{"answer": 42}']


def test_a_cut_answer_gives_back_what_it_held_as_content():
    assert _stream(["Hi <tool_call>", '{"name": "add", "argu'], cut=True) == ["Hi", ' <tool_call>{"name": "add", "argu']
    assert _stream([W], cut=True) == [W]


_TEXT = st.text(alphabet="ab <>/_{}\n", max_size=12).filter(lambda s: "<" not in s)
_SEGMENT = st.one_of(_TEXT, st.sampled_from([W, A]).map(lambda c: f"\n<tool_call>\n{c}\n</tool_call>\n"))


@settings(max_examples=300, deadline=None)
@given(segments=st.lists(_SEGMENT, max_size=6), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_split_gives_the_whole_answers_reading_and_no_marker_leaks(segments, cuts):
    """Fed in any pieces, the parser gives the same content and calls as the whole answer; no content piece
    holds any part of a block that became a call (the text between blocks has no "<" here, so no "<" at all)."""
    text = "".join(segments)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    items = _stream(pieces)
    calls = [i for i in items if isinstance(i, Call)]
    content = "".join(i for i in items if isinstance(i, str))
    whole_content, whole_calls = parse_tool_calls(text, NAMES)
    assert calls == whole_calls and calls == [WC if s.strip().endswith(f"{W}\n</tool_call>") else AC
                                              for s in segments if OPEN in s]
    assert (content if not calls or content.strip() else None) == whole_content
    if calls:
        assert all("<" not in i for i in items if isinstance(i, str))
    else:
        assert content == text


def test_the_array_reader_names_each_call_then_streams_its_arguments():
    """The guided array, read a character at a time: each call named once its name string closes, its
    arguments given out as they come, joined exactly their JSON text (strings with escapes, nesting)."""
    text = '[ {"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "n": [1, {"a": 2}]}}, ' \
           '{"name":"add","arguments":{"a":1,"b":-2.5e3}}]'
    reader = CallArrayReader()
    items = [item for ch in text for item in reader.feed(ch)]
    assert [i for i in items if isinstance(i, Named)] == [Named(0, "get_weather"), Named(1, "add")]
    first_args = next(k for k, i in enumerate(items) if isinstance(i, Arguments))
    assert items.index(Named(0, "get_weather")) < first_args
    args = {c: "".join(i.text for i in items if isinstance(i, Arguments) and i.call == c) for c in (0, 1)}
    assert [json.loads(args[c]) for c in (0, 1)] == [c["arguments"] for c in json.loads(text)]
    assert args[0] == '{"city": "Pa\\"ris}", "n": [1, {"a": 2}]}' and args[1] == '{"a":1,"b":-2.5e3}'
    assert len([i for i in items if isinstance(i, Arguments)]) > 10      # piece by piece, not at the end
    assert CallArrayReader().feed(text) == [Named(0, "get_weather"), Arguments(0, args[0]), Named(1, "add"),
                                            Arguments(1, args[1])]


def test_the_array_reader_holds_arguments_read_before_the_name():
    reader = CallArrayReader()
    assert reader.feed('[{"arguments": {"a": 1}, ') == []
    assert reader.feed('"name": "add"}]') == [Named(0, "add"), Arguments(0, '{"a": 1}')]


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "add")]


def _deltas(mode, pieces, finish="stop"):
    d = ToolDeltas(mode)
    out = [x for p in pieces for x in d.feed(p)]
    more, reason = d.finish(finish)
    return out + more, reason


def _joined(deltas):
    """The calls as the openai package's stream helpers put them together: by index, strings appended."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            cur = calls.setdefault(c["index"], {"id": "", "name": "", "arguments": ""})
            cur["id"] += c.get("id", "")
            cur["name"] += c.get("function", {}).get("name", "")
            cur["arguments"] += c.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("choice, text, calls, finish", [
    ("required", '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]',
     [("add", '{"a": 1}'), ("get_weather", "{}")], "tool_calls"),
    ({"type": "function", "function": {"name": "add"}}, '{"a": 1, "b": 2}', [("add", '{"a": 1, "b": 2}')], "stop"),
    ("auto", f"Sure. <tool_call>{A}</tool_call>", [("add", '{"a": 1, "b": 2}')], "tool_calls"),
])
def test_streamed_and_whole_messages_agree(choice, text, calls, finish):
    """Each mode's stream deltas, joined as clients do, give the whole message's calls (ids aside), each call's
    id once; both finish alike: tool_calls, or stop under a named function (OpenAI's answer there)."""
    mode = tool_mode(TOOLS, choice, None)
    message, reason = tool_message(mode, text, "stop")
    assert reason == finish
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    for pieces in ([text], list(text), [text[:7], text[7:20], text[20:]]):
        deltas, reason = _deltas(mode, pieces)
        joined = _joined(deltas)
        assert reason == finish and [(c["name"], c["arguments"]) for c in joined] == calls
        assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in joined)
        content = "".join(d.get("content", "") for d in deltas)
        assert content == (message["content"] or "")


def test_a_cut_or_unreadable_answer_is_text():
    """Cut by length (or aborted), the answer is content as written, with that finish_reason; a guided answer
    that is no JSON (a stop string cut it) is content too."""
    for choice, text in (("required", '[{"name": "add", "argu'), ("auto", f"<tool_call>{A}"),
                         ({"type": "function", "function": {"name": "add"}}, '{"a": 1')):
        mode = tool_mode(TOOLS, choice, None)
        assert tool_message(mode, text, "length") == ({"role": "assistant", "content": text}, "length")
        assert tool_message(mode, text, "abort")[1] == "abort"
        assert _deltas(mode, [text], "length")[1] == "length"
    mode = tool_mode(TOOLS, "required", None)
    assert tool_message(mode, "[{", "stop") == ({"role": "assistant", "content": "[{"}, "stop")
    assert tool_message(tool_mode(TOOLS, "auto", None), "Just text.", "stop") == \
        ({"role": "assistant", "content": "Just text."}, "stop")


def test_stream_choices_put_logprobs_on_the_first_delta_and_finish_last():
    mode = tool_mode(TOOLS, "auto", None)
    d = ToolDeltas(mode)
    assert stream_choices(d, 3, "<tool", None, None) == []
    assert stream_choices(d, 3, "_ca", None, {"content": []}) == [
        {"index": 3, "delta": {}, "logprobs": {"content": []}, "finish_reason": None}]
    out = stream_choices(d, 3, f"ll>{A}</tool_call>", "stop", None)
    assert [c["finish_reason"] for c in out] == [None, "tool_calls"] and out[-1]["delta"] == {}
    assert out[0]["delta"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
