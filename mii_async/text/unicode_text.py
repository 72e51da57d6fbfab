"""Text that no wire can carry. A lone UTF-16 surrogate (U+D800 … U+DFFF) is legal in a Python str and in
JSON ("\\ud800"), but it is not Unicode text: UTF-8 cannot encode it, so msgpack, the tokenizer and every
reply would fail on it. Callers' strings are checked where they come in, and the error names the field.
"""
from __future__ import annotations

import json
import re
from typing import Any

from ..errors import InvalidParameterError

# Where a JSON text can hold a surrogate: an escape \uD800 … \uDFFF, or one encoded as UTF-8 (ED A0 80 …),
# which json.loads accepts from bytes. Texts without either need no walk.
_MAYBE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def lone_surrogate(obj: Any, path: str) -> tuple[str, str] | None:
    """(path, why) of the first string in `obj` (a value or a key, through dicts, lists and tuples) that is not
    Unicode text, or None. Paths read `messages[0].content`, as errors name fields everywhere."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, f"is not valid Unicode: a lone surrogate U+{ord(obj[exc.start]):04X} at position {exc.start}"
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            # a bad key is named by its escaped form: the error's own text must be valid too
            key = k.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(k, str) else str(k)
            sub = f"{path}.{key}" if path else key
            if (isinstance(k, str) and (bad := lone_surrogate(k, sub))) or (bad := lone_surrogate(v, sub)):
                return bad
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            if not isinstance(v, (int, float)) and (bad := lone_surrogate(v, f"{path}[{i}]")):
                return bad
    return None


def check_text(param: str, obj: Any) -> None:
    """Raises InvalidParameterError naming where in `obj` (the value of `param`) a string is not text."""
    if bad := lone_surrogate(obj, param):
        raise InvalidParameterError(*bad)


def check_json_text(raw: bytes | str, parsed: Any = None) -> None:
    """The same for a JSON body or frame, parsed only when its raw text could hold a surrogate (`parsed`, when
    given, saves parsing it again); the path starts at the body's own fields (`prompt`, `messages[0].content`).
    Text that is not JSON passes: its parser reports it."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    # json.loads also reads UTF-16 and UTF-32 bodies, where the pattern means nothing: those are walked always
    if not _MAYBE.search(data) and (isinstance(raw, str) or json.detect_encoding(data) == "utf-8"):
        return
    if parsed is None:
        try:
            parsed = json.loads(data)
        except (ValueError, RecursionError):   # not JSON, or nested past the parser: its parser reports it
            return
    try:
        bad = lone_surrogate(parsed, "")
    except RecursionError:
        raise InvalidParameterError("body", "is nested too deeply") from None
    if bad:
        raise InvalidParameterError(bad[0].lstrip(".") or "body", bad[1])
