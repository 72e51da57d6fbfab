"""Guided (structured) generation: what a request's output must match, as one regular expression.

A request names at most one of `guided_json` (a JSON schema; `{"type": "object"}` is OpenAI's JSON mode),
`guided_regex` or `guided_choice` (a list of strings, one of which is the whole output). Each becomes a regex
here, through outlines-core's JSON-schema compiler; the replica's engine compiles the regex against its
tokenizer's vocabulary into a token automaton and masks, at each step, every token that would leave it
(workers/sampling/guides.py). No torch here: the client, the router and the gateway check requests with it.
"""
from __future__ import annotations

import functools
import json
import math
import re
from decimal import Decimal
from typing import Any

from .errors import InvalidParameterError
from .text.unicode_text import check_text

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
    # two agree on brackets and repeats) but not what only Rust knows (\p{L}, \x{263A}, (?U), (?<name>…),
    # (?-u:…)): that goes on to the replica, which refuses what outlines-core cannot compile, naming
    # guided_regex too.
    try:
        re.compile(v)
    except re.error as exc:
        if not str(exc).startswith(_RUST_ONLY):
            raise InvalidParameterError("guided_regex", f"is not a regular expression: {exc}") from None
    return v


# Python's complaints about syntax that Rust's regex takes
_RUST_ONLY = ("bad escape", "incomplete escape \\x", "unknown extension ?", "bad inline flags", "unknown flag")


@functools.lru_cache(maxsize=256)
def schema_regex(schema_json: str) -> str:
    """The regex of the texts a JSON schema admits (outlines-core's compiler: compact whitespace), with what
    that compiler leaves out or gets wrong put right (see `_holes`): numeric bounds, formats date, time and
    date-time, property names that JSON escapes, and JSON Schema's ASCII \\d and \\w in patterns."""
    from outlines_core.json_schema import build_regex_from_schema

    holes: dict[str, str] = {}
    try:
        schema = _holes(json.loads(schema_json), holes, _marker_base(schema_json))
        regex = build_regex_from_schema(json.dumps(schema, ensure_ascii=False) if holes else schema_json)
    except InvalidParameterError:
        raise
    except Exception as exc:  # noqa: BLE001 - outlines-core raises its own types for schemas it cannot take
        raise InvalidParameterError("guided_json", f"unsupported JSON schema: {exc}") from None
    regex = _ascii_classes(regex)
    for marker, sub in holes.items():        # after _ascii_classes: our own pieces hold no \\d
        regex = regex.replace(marker, f"(?:{sub})")
    return regex


# -- what outlines-core's JSON-schema compiler does not enforce, enforced here ---------------------------------
# outlines-core reads `minimum`, `maximum`, `exclusiveMinimum` and `exclusiveMaximum` but ignores them (so
# pydantic's Field(ge=0, le=1) or PositiveInt came back out of range), writes format "time" with `\\.` (a
# backslash and any character: not JSON) and "date-time" with years of any length (pydantic refuses them),
# writes property names unescaped for JSON, and passes a pattern's \\d and \\w to Rust's regex, where they
# are Unicode (JSON Schema's patterns are ECMA-262's: ASCII). Each such subschema (or name) is swapped for a
# marker before compiling (a const integer; a plain name), and the marker in the regex for our own regex.
_NUMERIC = ("integer", "number")
SCHEMA_VALUE_KEYS = ("const", "enum", "default", "examples")   # values, not schemas: never rewritten
SCHEMA_MAP_KEYS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")   # name → schema
_TIME = r"(2[0-3]|[01][0-9]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-](2[0-3]|[01][0-9]):[0-5][0-9])?"
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_FORMATS = {"time": f'"{_TIME}"', "date": f'"{_DATE}"', "date-time": f'"{_DATE}T{_TIME}"'}   # 4-digit years


def _marker_base(text: str) -> str:
    base = "9317"
    while base in text:                      # never a number the schema itself holds
        base += "7"
    return base


def _holes(node: Any, holes: dict[str, str], base: str) -> Any:
    if isinstance(node, list):
        return [_holes(v, holes, base) for v in node]
    if not isinstance(node, dict):
        return node
    if (sub := _own_regex(node)) is not None:
        marker = f"{base}{len(holes):04d}{base}"
        holes[marker] = sub
        return {"const": int(marker)}
    types = node.get("type")
    if isinstance(types, list) and any(t in _NUMERIC for t in types) and _bounds(node)[::2] != (None, None):
        rest = [t for t in types if t not in _NUMERIC]     # [integer, null] with bounds: one of them, apart
        alts = [{**node, "type": t} for t in types if t in _NUMERIC] + ([{**node, "type": rest}] if rest else [])
        return _holes({"anyOf": alts}, holes, base)
    out = {k: v if k in SCHEMA_VALUE_KEYS else {n: _holes(sub, holes, base) for n, sub in v.items()}
           if k in SCHEMA_MAP_KEYS and isinstance(v, dict) else _holes(v, holes, base) for k, v in node.items()}
    props = out.get("properties")
    if isinstance(props, dict) and any(map(_needs_escape, props)):
        # outlines-core writes a property's name as it is, unescaped for JSON (a " or \\ or a newline in it
        # made the output invalid JSON): such a name is a marker, and the marker its JSON-escaped text
        names = {}
        for k in filter(_needs_escape, props):
            names[k] = f"{base}{len(holes):04d}{base}"
            holes[names[k]] = _escape(json.dumps(k, ensure_ascii=False)[1:-1])
        out["properties"] = {names.get(k, k): v for k, v in props.items()}
        if isinstance(out.get("required"), list):
            out["required"] = [names.get(k, k) if isinstance(k, str) else k for k in out["required"]]
    return out


def _needs_escape(name: str) -> bool:
    return json.dumps(name, ensure_ascii=False) != f'"{name}"'


def _own_regex(node: dict[str, Any]) -> str | None:
    """Our regex of a subschema outlines-core would get wrong, or None to leave it to outlines-core."""
    if "const" in node or "enum" in node or any(k in node for k in ("anyOf", "oneOf", "allOf", "$ref")):
        return None
    if node.get("type") == "string" and node.get("format") in _FORMATS and "pattern" not in node:
        return _FORMATS[node["format"]]
    if node.get("type") not in _NUMERIC:
        return None
    lo, lo_in, hi, hi_in = _bounds(node)
    if lo is None and hi is None:
        return None
    if node["type"] == "integer":
        lo_i = None if lo is None else (math.floor(lo) + 1 if not lo_in or lo != math.floor(lo) else int(lo))
        hi_i = None if hi is None else (math.ceil(hi) - 1 if not hi_in or hi != math.ceil(hi) else int(hi))
        lo, lo_in, hi, hi_in = (None if lo_i is None else Decimal(lo_i)), True, \
            (None if hi_i is None else Decimal(hi_i)), True
    regex = _signed(lo, lo_in, hi, hi_in, node["type"] == "number")
    if regex is None:
        raise InvalidParameterError("guided_json", f"no {node['type']} lies within the bounds of {json.dumps(node)}")
    return regex


def _bounds(node: dict[str, Any]) -> tuple[Decimal | None, bool, Decimal | None, bool]:
    """(lower, inclusive, upper, inclusive) of a numeric schema; None where unbounded."""
    def num(key: str) -> Decimal | None:
        v = node.get(key)
        return Decimal(repr(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    lo, lo_in, hi, hi_in = num("minimum"), True, num("maximum"), True
    if node.get("exclusiveMinimum") is True:        # draft 4: a flag on minimum
        lo_in = False
    elif (x := num("exclusiveMinimum")) is not None and (lo is None or x >= lo):
        lo, lo_in = x, False
    if node.get("exclusiveMaximum") is True:
        hi_in = False
    elif (x := num("exclusiveMaximum")) is not None and (hi is None or x <= hi):
        hi, hi_in = x, False
    return lo, lo_in, hi, hi_in


def _signed(lo: Decimal | None, lo_in: bool, hi: Decimal | None, hi_in: bool, frac: bool) -> str | None:
    """A JSON number (no exponent; a fraction only if `frac`) in the range, or None if the range is empty."""
    parts = []
    if hi is None or hi > 0 or (hi == 0 and hi_in):                       # x >= 0
        low, low_in = (Decimal(0), True) if lo is None or lo < 0 else (lo, lo_in)
        parts.append(_unsigned(low, low_in, hi, hi_in, frac))
    if lo is None or lo < 0:                                               # x = -y, y > 0
        low, low_in = (-hi, hi_in) if hi is not None and hi < 0 else (Decimal(0), False)
        if (y := _unsigned(low, low_in, None if lo is None else -lo, lo_in, frac)) is not None:
            parts.append("-" + (y if y.startswith("(") else f"(?:{y})"))
    parts = [p for p in parts if p is not None]
    return "|".join(parts) if parts else None


def _split(d: Decimal) -> tuple[int, str]:
    """A non-negative decimal's integer part and its fraction's digits (no trailing zeros)."""
    whole, _, fraction = format(d, "f").partition(".")
    return int(whole), fraction.rstrip("0")


def _unsigned(lo: Decimal, lo_in: bool, hi: Decimal | None, hi_in: bool, frac: bool) -> str | None:
    """`(0|[1-9][0-9]*)(\\.[0-9]+)?` (the fraction only if `frac`) in the range, lo >= 0."""
    if hi is not None and (hi < lo or (hi == lo and not (lo_in and hi_in))):
        return None
    (a, fa), (b, fb) = _split(lo), (None, None) if hi is None else _split(hi)
    branches: list[tuple[int, int | None, tuple | None]] = []    # (first, last int part, fraction bounds)
    if b == a:
        branches.append((a, a, (fa, lo_in, fb, hi_in)))
    else:
        branches.append((a, a, (fa, lo_in, None, True)))
        branches.append((a + 1, None if b is None else b - 1, (None, True, None, True)))
        if b is not None:
            branches.append((b, b, (None, True, fb, hi_in)))
    out = []
    for first, last, fb_ in branches:
        if last is not None and last < first:
            continue
        ne, empty = _fraction(*fb_) if frac else (None, _fraction(*fb_)[1])
        if ne is None and not empty:
            continue
        ints = _int_range(first, last)
        tail = "" if ne is None else (rf"\.(?:{ne})" if not empty else rf"(\.(?:{ne}))?")
        out.append(f"(?:{ints}){tail}")
    return "(" + "|".join(out) + ")" if out else None


def _int_range(a: int, b: int | None) -> str:
    """Integers a..b (b None: unbounded) without leading zeros, a >= 0."""
    if b is None:
        n = len(str(a))
        return f"{_int_range(a, 10 ** n - 1)}|[1-9][0-9]{{{n},}}"
    out = []
    for n in range(len(str(a)), len(str(b)) + 1):
        lo, hi = max(a, 10 ** (n - 1) if n > 1 else 0), min(b, 10 ** n - 1)
        out.append(_fixed(str(lo), str(hi)))
    return "|".join(out)


def _fixed(lo: str, hi: str) -> str:
    """Digit strings of one length from lo to hi."""
    if lo == hi:
        return lo
    if lo[0] == hi[0]:
        return lo[0] + f"(?:{_fixed(lo[1:], hi[1:])})"
    rest, parts = len(lo) - 1, []
    d_lo, d_hi = int(lo[0]), int(hi[0])
    if lo[1:] != "0" * rest:
        parts.append(lo[0] + f"(?:{_fixed(lo[1:], '9' * rest)})")
        d_lo += 1
    if hi[1:] != "9" * rest:
        parts.append(hi[0] + f"(?:{_fixed('0' * rest, hi[1:])})")
        d_hi -= 1
    if d_lo <= d_hi:
        parts.append(f"[{d_lo}-{d_hi}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return "|".join(parts)


def _fraction(lo: str | None, lo_in: bool, hi: str | None, hi_in: bool) -> tuple[str | None, bool]:
    """The digit strings s with 0.s within (0.lo, 0.hi) (bounds None: open; `_in`: inclusive) → (a regex of the
    non-empty ones or None if there are none, whether the empty one, value 0, is in)."""
    if lo == "" and lo_in:
        lo = None
    empty = lo is None and (hi is None or hi != "" or hi_in)
    if hi == "":                                      # 0 exactly
        return ("0+", True) if hi_in and lo is None else (None, False)
    if lo == "" and hi is None:                       # more than 0
        return "0*[1-9][0-9]*", False
    if lo is None and hi is None:
        return "[0-9]+", True
    groups: dict[tuple, list[int]] = {}
    for c in range(10):
        if lo is not None and c < int(lo[0] if lo else 0) or hi is not None and c > int(hi[0]):
            continue
        sub_lo = (lo[1:], lo_in) if lo is not None and c == int(lo[0] if lo else 0) else (None, True)
        sub_hi = (hi[1:], hi_in) if hi is not None and c == int(hi[0]) else (None, True)
        groups.setdefault((sub_lo, sub_hi), []).append(c)
    parts = []
    for ((l, li), (h, hi_)), digits in groups.items():
        ne, emp = _fraction(l, li, h, hi_)
        if ne is None and not emp:
            continue
        cls = f"[{digits[0]}-{digits[-1]}]" if len(digits) > 1 else str(digits[0])
        parts.append(cls + ("" if ne is None else f"(?:{ne})" + ("?" if emp else "")))
    return ("|".join(parts) or None), empty


def _ascii_classes(regex: str) -> str:
    """\\d and \\w as ECMA-262 reads them (ASCII), not as Rust's regex does (Unicode)."""
    out, i, depth = [], 0, 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            pair, i = regex[i:i + 2], i + 2
            inner = {"\\d": "0-9", "\\w": "0-9A-Za-z_"}.get(pair)
            out.append(pair if inner is None else (inner if depth else f"[{inner}]"))
            continue
        if ch == "[":
            depth += 1
        elif ch == "]" and depth:
            depth -= 1
        out.append(ch)
        i += 1
    return "".join(out)


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
