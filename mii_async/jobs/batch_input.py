"""A batch's input file (JSONL, one request a line) checked whole before any line runs.

Each line is `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {...}}`. As OpenAI
does, any bad line fails the whole batch in validation (status "failed", `errors.data` listing each line's
fault, 1-based line numbers), and nothing runs: a malformed line, a missing or duplicate custom_id, a method
other than POST, a url other than the batch's endpoint, and a body the route would refuse on its own (its
schema, `stream: true`, another model: `check_body`). What only the model's router can judge — a prompt too long
for the context, a guide it cannot compile, a failure while generating — is found when the line runs, and that
line's answer goes to the batch's error file while the others go on.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from ..errors import InvalidParameterError
from ..text.unicode_text import check_json_text
from .store import Line

MAX_REPORTED_ERRORS = 100    # a file with more bad lines lists the first of them; the batch fails either way
# check_body(url, body) → None if the route accepts the body's shape, else (param, message)
BodyCheck = Callable[[str, dict], "tuple[str | None, str] | None"]


def _error(code: str, message: str, line: int | None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_batch_input(data: bytes, endpoint: str, check_body: BodyCheck, max_lines: int) -> \
        tuple[list[Line], list[dict[str, Any]]]:
    """The file's lines, and the errors that fail the batch (empty when it may run)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [_error("invalid_file", f"the input file is not UTF-8 text: {exc}", None)]
    raw = [(n, s) for n, s in enumerate(text.splitlines(), 1) if s.strip()]
    if not raw:
        return [], [_error("empty_file", "the input file has no request lines", None)]
    if len(raw) > max_lines:
        return [], [_error("too_many_lines", f"the input file has {len(raw)} request lines; a batch may hold at "
                           f"most {max_lines}", None)]
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for n, s in raw:
        err = None
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as exc:
            obj, err = None, _error("invalid_json_line", f"line {n} is not valid JSON: {exc.msg}", n)
        if err is None:
            try:
                check_json_text(s, obj)        # a lone surrogate ("\\ud800") is JSON, not text
            except InvalidParameterError as exc:
                err = _error("invalid_request", f"line {n}: {exc}", n, exc.param)
        if err is None:
            err = _check_line(obj, n, endpoint, check_body, seen)
        if err is not None:
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(err)
            else:
                break
            continue
        seen[obj["custom_id"]] = n
        lines.append(Line(len(lines), obj["custom_id"], obj["url"], obj["body"]))
    return lines, errors


def _check_line(obj: Any, n: int, endpoint: str, check_body: BodyCheck, seen: dict[str, int]) -> dict | None:
    if not isinstance(obj, dict):
        return _error("invalid_json_line", f"line {n} must be a JSON object", n)
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return _error("invalid_request", f"line {n}: unknown field {unknown[0]!r}", n, unknown[0])
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return _error("invalid_request", f"line {n}: custom_id must be a non-empty string", n, "custom_id")
    if cid in seen:
        return _error("duplicate_custom_id", f"line {n}: custom_id {cid!r} is also on line {seen[cid]}; each "
                      "must be unique within a batch", n, "custom_id")
    if obj.get("method") != "POST":
        return _error("invalid_request", f"line {n}: method must be 'POST', got {obj.get('method')!r}", n,
                      "method")
    if obj.get("url") != endpoint:
        return _error("invalid_url", f"line {n}: url must be the batch's endpoint {endpoint!r}, got "
                      f"{obj.get('url')!r}", n, "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return _error("invalid_request", f"line {n}: body must be a JSON object", n, "body")
    refused = check_body(endpoint, body)
    if refused is not None:
        param, message = refused
        return _error("invalid_request", f"line {n}: {message}", n, f"body.{param}" if param else "body")
    return None
