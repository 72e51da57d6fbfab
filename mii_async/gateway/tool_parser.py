"""ToolCallParser: a free-text answer (tool_choice auto) → its content and the function calls it makes, as the
text streams in.

A call is a block `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (the Hermes / Qwen format, which the
fallback prompt asks for: text/chat_tools.py), or a whole answer that is exactly such a JSON object (Llama 3.1's
habit; "parameters" is read as "arguments" in both). A block whose JSON does not parse, or names a function
that was not given, stays in the content as it was written (as vLLM does); nothing here raises on a model's
text. Text outside the blocks is the content.

Streaming: content goes out as it comes, except what a call may be starting with — a tail that is a prefix of
`<tool_call>`, the body of an open block, an answer that so far is a JSON object — and trailing whitespace,
held until the next text shows whether it leads into a call (whitespace around calls is dropped). An answer
without calls is therefore given back exactly as written. Feeding the whole answer at once gives the same
content and calls as feeding it in any pieces.
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple

from ..text.chat_tools import CALL_CLOSE, CALL_OPEN

OPEN, CLOSE = CALL_OPEN, CALL_CLOSE   # the markers the prompt asks for (text/chat_tools.py)
_decoder = json.JSONDecoder()


class Call(NamedTuple):
    name: str
    arguments: str        # JSON text of an object


def read_call(obj: Any, names: frozenset[str]) -> Call | None:
    """A decoded JSON value as a call of one of `names`: {"name", "arguments" | "parameters": object (or the JSON
    text of one)}; a call without arguments takes {}. None when it is not such a call."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return None
        return Call(obj["name"], args) if isinstance(parsed, dict) else None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def read_call_text(text: str, names: frozenset[str]) -> Call | None:
    try:
        return read_call(json.loads(text), names)
    except ValueError:
        return None


def _marker_tail(text: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of OPEN (a marker perhaps starting)."""
    for k in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    """One answer's parser. feed() and finish() return what can be given out now: content strings and Calls, in
    order. With parallel False, calls after the first are dropped (OpenAI's parallel_tool_calls: false)."""

    def __init__(self, names: frozenset[str], parallel: bool = True) -> None:
        self.names, self.parallel = names, parallel
        self.calls = 0             # calls given out
        self._buf = ""             # text not yet resolved (see _mode)
        self._ws = ""              # trailing whitespace of the content, held
        self._said = False         # some content given out
        self._mode = "lead"        # lead: only whitespace so far, or a JSON object; text; call: inside a block
        self._lead: tuple[Call, int] | None = None     # lead: the whole-answer call decoded, and where it ends
        self._out: list[str | Call] = []

    def feed(self, text: str) -> list[str | Call]:
        self._buf += text
        self._pump(final=False, fresh=text)
        return self._take()

    def finish(self, cut: bool = False) -> list[str | Call]:
        """The end of the answer. `cut` (it ran out of tokens): what is held is content, not a call."""
        if cut:
            self._content(("" if self._mode != "call" else OPEN) + self._buf)
            self._buf = ""
        else:
            self._pump(final=True, fresh="")
        if self.calls == 0 and self._ws:      # no calls: the text exactly as written
            self._emit(self._ws)
        self._ws = ""
        return self._take()

    def _take(self) -> list[str | Call]:
        out, self._out = self._out, []
        return out

    def _emit(self, item: str | Call) -> None:
        if isinstance(item, str) and self._out and isinstance(self._out[-1], str):
            self._out[-1] += item
        else:
            self._out.append(item)

    def _content(self, text: str) -> None:
        text = self._ws + text
        if self.calls and not self._said:
            text = text.lstrip()          # the content starts after a call: its leading whitespace is layout
        kept = text.rstrip()
        if kept:
            self._emit(kept)
            self._said = True
        self._ws = text[len(kept):]

    def _call(self, call: Call) -> None:
        self._ws = ""                     # whitespace before a call is layout, not content
        if self.parallel or self.calls == 0:
            self._emit(call)
            self.calls += 1

    def _pump(self, final: bool, fresh: str) -> None:
        while True:
            if self._mode == "lead" and not self._pump_lead(final, fresh):
                return
            if self._mode == "text":
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = 0 if final else _marker_tail(self._buf)
                    self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._content(self._buf[:i])
                self._buf = self._buf[i + len(OPEN):]
                self._mode = "call"
            if self._mode == "call":
                j = self._buf.find(CLOSE)
                if j < 0 and not final:
                    return
                body = self._buf if j < 0 else self._buf[:j]
                call = read_call_text(body, self.names)
                if call is not None:
                    self._call(call)
                else:
                    self._content(OPEN + body + ("" if j < 0 else CLOSE))
                self._buf = "" if j < 0 else self._buf[j + len(CLOSE):]
                self._mode = "text"

    def _pump_lead(self, final: bool, fresh: str) -> bool:
        """The answer so far is whitespace, or starts with "{": a whole-answer call perhaps. True when it
        turned out to be text (the mode is text now); False to wait (or, final, when it was the call)."""
        s = self._buf.lstrip()
        if not s:
            if final:
                self._mode = "text"
            return final
        if s[0] != "{":
            self._mode = "text"
            return True
        if self._lead is None:
            if "}" not in fresh and not final:
                return False                # an object can only end on a "}"
            try:
                obj, end = _decoder.raw_decode(s)
            except ValueError:              # not complete yet (or never: then it is content, at the end)
                if final:
                    self._mode = "text"
                return final
            call = read_call(obj, self.names)
            if call is None:                # JSON, but no call of ours: content
                self._mode = "text"
                return True
            self._lead = (call, end)
        call, end = self._lead
        if s[end:].strip():                 # text after the object: the answer is not just a call
            self._mode, self._lead = "text", None
            return True
        if final:
            self._call(call)
            self._buf = ""
        return False


def parse_tool_calls(text: str, names: frozenset[str], parallel: bool = True) -> tuple[str | None, list[Call]]:
    """A whole answer → (content, calls). With calls, content is None when no text is left besides them;
    without, it is the answer as written."""
    p = ToolCallParser(names, parallel)
    items = p.feed(text) + p.finish()
    calls = [c for c in items if isinstance(c, Call)]
    content = "".join(c for c in items if isinstance(c, str))
    if calls and not content.strip():
        return None, calls
    return content, calls
