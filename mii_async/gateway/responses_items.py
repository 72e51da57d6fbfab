"""The Responses API's items ⇄ chat messages, and an answer as output items, whole or as stream events.

Input: a text is one user message; an item with a role is that message (its content a text or a list of
input_text / output_text parts: text only); a function_call item is a call of the assistant's (calls in a row,
and a call right after an assistant's message, join that message, as chat templates show parallel calls); a
function_call_output item is a tool message. Each error names the item as the caller wrote it:
`input[2].content[0].type`.

Output: an answer's text is one "message" item with one "output_text" part; each of its calls (read as chat's
are: tool_answer.py) is a "function_call" item. Streamed, ResponseEvents turns chat-style deltas into OpenAI's
events — output_item.added, content_part.added, output_text.delta, function_call_arguments.delta as they
come — and closes every item (the .done events) when the answer ends, before response.completed (or
.incomplete, .failed). Every event carries its sequence_number.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from .http_errors import bad_request

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(items: str | list[dict[str, Any]], paths: list[str]) -> list[dict[str, Any]]:
    """`input` → chat messages (openai_params.chat_messages' form); appends to `paths` where each message came
    from (`input[3]`), so that an error about a message names the item."""
    if isinstance(items, str):
        paths.append("input")
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input", "input must be a non-empty text or list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{at}.role", f"role must be one of {', '.join(_ROLES)}, got {role!r}")
            out.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
            paths.append(at)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", at), "type": "function",
                    "function": {"name": _string(item, "name", at), "arguments": _string(item, "arguments", at)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)      # the calls of one turn, with its text
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                paths.append(at)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", at),
                        "content": output if isinstance(output, str) else _text(output, f"{at}.output")})
            paths.append(at)
        else:
            raise bad_request(f"{at}.type", "input items are messages, function_call and function_call_output "
                              f"items (text only), got type {kind!r}")
    return out


def _string(item: dict[str, Any], key: str, at: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad_request(f"{at}.{key}", f"{key} must be a string")
    return v


def _text(content: Any, at: str) -> str:
    """A message's content: a text, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(at, "content must be a text or a list of input_text parts")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{at}[{k}].type", f"only text parts (input_text, output_text) are supported, got "
                                                 f"{kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def message_item(text: str, logprobs: list[dict] | None, status: str, msg_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": msg_id or item_id("msg"), "status": status, "role": "assistant",
            "content": [_part(text, logprobs)]}


def _part(text: str, logprobs: list[dict] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(call: dict[str, Any], status: str = "completed", fc_id: str | None = None) -> dict[str, Any]:
    """A chat tool call ({"id", "type", "function": {"name", "arguments"}}) as a function_call item."""
    fn = call.get("function", {})
    return {"type": "function_call", "id": fc_id or item_id("fc"), "call_id": call["id"], "name": fn.get("name", ""),
            "arguments": fn.get("arguments", ""), "status": status}


def output_items(message: dict[str, Any], logprobs: list[dict] | None, status: str) -> list[dict[str, Any]]:
    """A whole chat answer's message (tool_answer.tool_message's) → output items."""
    calls = message.get("tool_calls") or []
    content = message.get("content")
    items = [message_item(content, logprobs, status)] if content is not None and (content or not calls) else []
    return items + [call_item(c) for c in calls]


def answer_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the assistant's chat message, for the conversation a continuation replays."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    if calls:
        turn["tool_calls"] = calls
    return turn


class ResponseEvents:
    """One streamed answer's events (server-sent, each `event: <type>` with its JSON), from the chat-style
    deltas of tool_answer.ToolDeltas or of plain text: {"content": text} or {"tool_calls": [one call's part]}.
    A text delta carries the logprobs of the steps since the last one; the message's whole list (every token's,
    as a whole answer's message has) comes with output_text.done. Whitespace before any text waits: an answer
    that turns out to be calls alone shows no message, as the whole answer would not."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []          # the output so far, by output_index
        self._message: int | None = None               # output_index of the message item, once opened
        self._text: list[str] = []                     # the message's text, as shown
        self._space = ""                                # whitespace before any text, not shown yet
        self._logprobs: list[dict] = []                # every token's so far
        self._held: list[dict] = []                    # those not shown with a text delta yet
        self._calls: dict[int, int] = {}               # a chat call's index → its item's output_index

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def delta(self, d: dict[str, Any], logprobs: list[dict] | None) -> list[str]:
        self._logprobs += logprobs or []
        self._held += logprobs or []
        out: list[str] = []
        if text := d.get("content"):
            if self._message is None and not (self._space + text).strip():
                self._space += text
            else:
                text, self._space = self._space + text, ""
                out += self._show(text)
        for part in d.get("tool_calls") or []:
            out += self._call(part)
        return out

    def _show(self, text: str) -> list[str]:
        out = self._open_message() if self._message is None else []
        self._text.append(text)
        held, self._held = self._held, []
        out.append(self.event("response.output_text.delta", item_id=self.items[self._message]["id"],
                              output_index=self._message, content_index=0, delta=text, logprobs=held))
        return out

    def _open_message(self) -> list[str]:
        self._message = len(self.items)
        item = {**message_item("", None, "in_progress"), "content": []}
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=self._message, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=self._message,
                           content_index=0, part=_part("", None))]

    def _call(self, part: dict[str, Any]) -> list[str]:
        i = part["index"]
        args = part.get("function", {}).get("arguments", "")
        out: list[str] = []
        if i not in self._calls:                        # its first part: id and name (and arguments so far)
            self._calls[i] = len(self.items)
            item = {**call_item(part, "in_progress"), "arguments": ""}
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=self._calls[i], item=dict(item)))
        if args:
            item = self.items[self._calls[i]]
            item["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self._calls[i], delta=args))
        return out

    def finish(self, status: str) -> list[str]:
        """Closes every item (`status`: the message's, "completed" or "incomplete"); `items` is then the
        response's output."""
        out: list[str] = []
        if self._message is None and not self._calls:   # no call: the answer is its text, whitespace or none
            out += self._show(self._space) if self._space else self._open_message()
        for index, item in enumerate(self.items):
            if item["type"] == "message":
                part = _part("".join(self._text), self._logprobs)
                out += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=self._logprobs),
                        self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
                self.items[index] = {**item, "status": status, "content": [part]}
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
                self.items[index] = {**item, "status": "completed"}
            out.append(self.event("response.output_item.done", output_index=index, item=self.items[index]))
        return out
