"""Guided (structured) generation: what a request's output must match, as one regular expression.

A request names at most one of `guided_json` (a JSON schema; `{"type": "object"}` is OpenAI's JSON mode),
`guided_regex` or `guided_choice` (a list of strings, one of which is the whole output). Each becomes a regex
here, through outlines-core's JSON-schema compiler; the replica's engine compiles the regex against its
tokenizer's vocabulary into a token automaton and masks, at each step, every token that would leave it
(workers/guides.py). No torch here: the client, the router and the gateway check requests with it.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from .errors import InvalidParameterError
from .unicode_text import check_text

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice")
MAX_GUIDE_CHARS = 65536          # a schema's JSON text or a regex
MAX_CHOICES = 256


def normalize_json_schema(v: Any) -> str:
    """A schema given as a dict or as JSON text → its JSON text (property order kept: it is the output's)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as exc:
            raise InvalidParameterError("guided_json", f"must be a JSON schema: {exc}") from None
    if not isinstance(v, dict):
        raise InvalidParameterError("guided_json", f"must be a JSON schema (an object), got {type(v).__name__}")
    try:
        text = json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError("guided_json", f"must be JSON: {exc}") from None
    if len(text) > MAX_GUIDE_CHARS:
        raise InvalidParameterError("guided_json", f"at most {MAX_GUIDE_CHARS} characters of JSON")
    check_text("guided_json", text)
    return text


def normalize_choice(v: Any) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(c, str) and c for c in v):
        raise InvalidParameterError("guided_choice", "must be a non-empty list of non-empty strings")
    if len(v) > MAX_CHOICES or sum(map(len, v)) > MAX_GUIDE_CHARS:
        raise InvalidParameterError("guided_choice", f"at most {MAX_CHOICES} choices of {MAX_GUIDE_CHARS} characters")
    for c in v:
        check_text("guided_choice", c)
    return tuple(v)


def check_regex(v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_GUIDE_CHARS:
        raise InvalidParameterError("guided_regex",
                                    f"must be a regular expression of 1 to {MAX_GUIDE_CHARS} characters")
    check_text("guided_regex", v)
    # The dialect is outlines-core's (Rust's regex syntax); Python's parser catches broken syntax early (the
    # two agree on brackets and repeats) but not escapes only Rust knows (\p{L}): those go on to the replica,
    # which refuses what outlines-core cannot compile, naming guided_regex too.
    try:
        re.compile(v)
    except re.error as exc:
        if not str(exc).startswith("bad escape"):
            raise InvalidParameterError("guided_regex", f"is not a regular expression: {exc}") from None
    return v


@functools.lru_cache(maxsize=256)
def schema_regex(schema_json: str) -> str:
    """The regex of the texts a JSON schema admits (outlines-core's compiler: compact whitespace)."""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        return build_regex_from_schema(schema_json)
    except Exception as exc:  # noqa: BLE001 - outlines-core raises its own types for schemas it cannot take
        raise InvalidParameterError("guided_json", f"unsupported JSON schema: {exc}") from None


def guide_regex(name: str, value: Any) -> str:
    """The regex a request's guide (field `name`, normalized value) must match."""
    if name == "guided_json":
        return schema_regex(value)
    if name == "guided_choice":
        return "(" + "|".join(_escape(c) for c in value) + ")"
    return value


def _escape(text: str) -> str:
    """A literal for outlines-core's regex dialect, which refuses escapes of characters that are not special."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)
