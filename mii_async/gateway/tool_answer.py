"""One chat choice's answer under tools (tool_choice auto, required or named) → OpenAI's message with
`tool_calls`, whole (tool_message) or as stream deltas (ToolDeltas).

    auto       the text is parsed for calls (tool_parser.ToolCallParser); a call goes out whole, once read
    required   the guided text is the array of calls (call_array.CallArrayReader); each call goes out as a delta
               with its id, type, name and arguments "" when its name is read, then its arguments as they come
    named      the guided text is the one call's arguments: the first delta names it, the text follows

A call's `arguments` is JSON text. A choice that made calls finishes with "tool_calls", except under a named
tool_choice, where it finishes with "stop" (as OpenAI answers, streamed or not). An answer cut by
max_tokens (finish_reason "length"), or aborted, is text: non-streamed, its content as written and no calls (as
vLLM); streamed, the calls already sent stand and what was held back goes out as content.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from .call_array import Arguments, CallArrayReader, Named
from .tool_mode import ToolMode
from .tool_parser import Call, ToolCallParser, parse_tool_calls


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_message(mode: ToolMode, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """A whole answer → (message, finish_reason)."""
    plain = {"role": "assistant", "content": text}
    if finish_reason != "stop":
        return plain, finish_reason
    if mode.choice == "auto":
        content, calls = parse_tool_calls(text, mode.names, mode.parallel)
    elif mode.choice == "named":
        calls = [Call(mode.name, text)] if _is_json(text) else []
        content = None
    else:
        content, calls = None, _array_calls(text, mode)
    if not calls:
        return plain, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": [_call(*c) for c in calls]}, _made(mode)


def _made(mode: ToolMode) -> str:
    """The finish_reason of a choice that made its calls: OpenAI's "stop" for a forced named call."""
    return "stop" if mode.choice == "named" else "tool_calls"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _array_calls(text: str, mode: ToolMode) -> list[Call]:
    """The calls of a whole guided array, their arguments as written; [] unless it is one of our calls' arrays."""
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    if not isinstance(doc, list) or not doc or not all(isinstance(c, dict) and c.get("name") in mode.names
                                                       and "arguments" in c for c in doc):
        return []
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for item in CallArrayReader().feed(text):
        if isinstance(item, Named):
            names[item.call] = item.name
        else:
            args.setdefault(item.call, []).append(item.text)
    calls = [Call(names.get(i, ""), "".join(args.get(i, []))) for i in range(len(doc))]
    assert [c.name for c in calls] == [c["name"] for c in doc], "the reader and json disagree on the calls"
    return calls


class ToolDeltas:
    """One streamed choice: feed() each piece of text, finish() at its end; both return the deltas to send
    ({"content": …} or {"tool_calls": [one call's part]}), finish() also the choice's finish_reason."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.calls = 0                                 # calls begun
        self._parser = ToolCallParser(mode.names, mode.parallel) if mode.choice == "auto" else None
        self._reader = CallArrayReader() if mode.choice == "required" else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        if self._parser is not None:
            return [self._from_parser(item) for item in self._parser.feed(text)]
        if self._reader is not None:
            return [self._from_reader(item) for item in self._reader.feed(text)]
        out = [] if self.calls else [self._begin(0, self.mode.name)]
        if text:
            out.append(self._arguments(0, text))
        return out

    def finish(self, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        out: list[dict[str, Any]] = []
        if self._parser is not None:
            out = [self._from_parser(item) for item in self._parser.finish(cut=finish_reason != "stop")]
        elif self._reader is None and not self.calls:
            out = [self._begin(0, self.mode.name)]
        if self._parser is not None:
            made = self.calls > 0
        elif self._reader is not None:
            made = bool(_array_calls(self.text, self.mode))
        else:
            made = _is_json(self.text)
        return out, _made(self.mode) if made and finish_reason == "stop" else finish_reason

    def _from_parser(self, item: str | Call) -> dict[str, Any]:
        if isinstance(item, str):
            return {"content": item}
        i = self.calls
        self.calls += 1
        return {"tool_calls": [{"index": i, **_call(item.name, item.arguments)}]}

    def _from_reader(self, item: Named | Arguments) -> dict[str, Any]:
        if isinstance(item, Named):
            return self._begin(item.call, item.name)
        return self._arguments(item.call, item.text)

    def _begin(self, i: int, name: str) -> dict[str, Any]:
        self.calls += 1
        return {"tool_calls": [{"index": i, **_call(name, "")}]}

    @staticmethod
    def _arguments(i: int, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": i, "function": {"arguments": text}}]}


def stream_choices(d: ToolDeltas, index: int, text: str, finish_reason: str | None,
                   logprobs: dict | None) -> list[dict[str, Any]]:
    """The `choices` entries of one streamed step of a choice: one per delta (the step's logprobs on the first,
    or on an empty delta of their own), then, at the end, an empty delta with the finish_reason."""
    deltas = d.feed(text)
    finish = None
    if finish_reason is not None:
        more, finish = d.finish(finish_reason)
        deltas += more
    out = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
    if logprobs is not None:
        if not out:
            out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": None})
        out[0]["logprobs"] = logprobs
    if finish is not None:
        out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish})
    return out
