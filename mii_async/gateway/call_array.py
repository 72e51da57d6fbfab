"""CallArrayReader: a guided `tool_choice: required` answer, `[{"name": …, "arguments": …}, …]`, read as it streams:
each call's name as soon as its string is complete, then its arguments' JSON text piece by piece.

The guide (tool_mode.ToolMode.guided_json) makes the text valid JSON of that shape, with the keys in that order
and optional single spaces between tokens; the reader relies on neither the order nor the spacing, only on the
text being a prefix of JSON. Arguments read before their call's name (not with our guide) are held until it.
What the reader gives out for a call's arguments, joined, is exactly their JSON text in the answer.
"""
from __future__ import annotations

import json
from typing import NamedTuple

_WS = " \t\r\n"


class Named(NamedTuple):
    call: int                 # the call's index in the array
    name: str


class Arguments(NamedTuple):
    call: int
    text: str                 # the next piece of the arguments' JSON text


class CallArrayReader:
    def __init__(self) -> None:
        self.text = ""
        self._pos = 0                      # characters read
        self._stack: list[str] = []        # open containers: "[" or "{"
        self._in_str = self._esc = False
        self._call = -1                    # the call being read
        self._expect = ""                  # inside a call (depth 2): key, colon, value, comma
        self._key = ""                     # that call's current key
        self._start = -1                   # where the current key or value at depth 2 started
        self._kind = ""                    # that value's first character's class: container, string, literal
        self._args_at = -1                 # the arguments' text given out up to here (-1: not in arguments)
        self._named: set[int] = set()
        self._held: dict[int, list[str]] = {}   # arguments of calls not yet named
        self._out: list[Named | Arguments] = []

    def feed(self, text: str) -> list[Named | Arguments]:
        self.text += text
        t = self.text
        while self._pos < len(t):
            self._step(t[self._pos], self._pos)
            self._pos += 1
        if self._args_at >= 0 and self._args_at < len(t):     # arguments in progress: give out what came
            self._args(t[self._args_at:])
            self._args_at = len(t)
        out, self._out = self._out, []
        return out

    def _args(self, piece: str) -> None:
        if not piece:
            return
        if self._call in self._named:
            self._out.append(Arguments(self._call, piece))
        else:
            self._held.setdefault(self._call, []).append(piece)

    def _value_end(self, end: int) -> None:
        """The value at depth 2 that started at self._start ended before `end`."""
        if self._key == "name":
            try:
                name = json.loads(self.text[self._start:end])
            except ValueError:
                name = None
            if isinstance(name, str) and self._call not in self._named:
                self._named.add(self._call)
                self._out.append(Named(self._call, name))
                for piece in self._held.pop(self._call, []):
                    self._out.append(Arguments(self._call, piece))
        elif self._key == "arguments":
            self._args(self.text[self._args_at:end])
            self._args_at = -1
        self._expect, self._kind = "comma", ""

    def _value_start(self, at: int, kind: str) -> None:
        self._start, self._kind = at, kind
        if self._key == "arguments":
            self._args_at = at

    def _step(self, ch: str, at: int) -> None:
        depth = len(self._stack)
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if depth == 2 and self._expect == "key":
                    try:
                        self._key = json.loads(self.text[self._start:at + 1])
                    except ValueError:         # not from our guide: a key we do not read
                        self._key = ""
                    self._expect = "colon"
                elif depth == 2 and self._kind == "string":
                    self._value_end(at + 1)
            return
        if depth == 2 and self._kind == "literal" and (ch in _WS or ch in ",}"):
            self._value_end(at)                # a number, true, false or null ends at what follows it
        if ch == '"':
            self._in_str = True
            if depth == 2 and self._expect == "key":
                self._start = at
            elif depth == 2 and self._expect == "value":
                self._value_start(at, "string")
                self._expect = "in value"
        elif ch in "[{":
            if depth == 2 and self._expect == "value":
                self._value_start(at, "container")
                self._expect = "in value"
            self._stack.append(ch)
            if depth == 1 and ch == "{":       # a call begins
                self._call += 1
                self._expect, self._key = "key", ""
        elif ch in "]}":
            if self._stack:
                self._stack.pop()
            if depth == 3 and self._kind == "container":
                self._value_end(at + 1)
        elif depth == 2 and ch == ":" and self._expect == "colon":
            self._expect = "value"
        elif depth == 2 and ch == "," and self._expect == "comma":
            self._expect = "key"
        elif depth == 2 and self._expect == "value" and ch not in _WS:
            self._value_start(at, "literal")
            self._expect = "in value"
