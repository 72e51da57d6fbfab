"""ToolMode: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and how a chat answer is made and
read under them (docs/gateway.md, "Tool calling").

    none       the prompt leaves the tools out; the answer is text, not parsed
    auto       the prompt shows the tools; the answer is text, parsed for calls afterwards (tool_parser.py)
    required   the answer is guided into a JSON array of 1+ calls [{"name", "arguments"}] (at most one without
               parallel_tool_calls); each call's name is a given tool's, its arguments that tool's schema
    named      ({"type": "function", "function": {"name": …}}) the answer is guided into that tool's arguments

Every refusal is a 400 naming the parameter as the caller spelled it: `tools[0].function.name`, `tool_choice`, ….
A tool's `parameters` must be a schema our guided generation takes (outlines-core compiles it here, as
`response_format` is checked), so that required and named calls can always be guided.
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple

from ..errors import InvalidParameterError
from ..guided import SCHEMA_MAP_KEYS, SCHEMA_VALUE_KEYS
from ..params import SamplingParams
from ..text.chat_tools import MAX_TOOLS
from .http_errors import bad_request

NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")      # OpenAI's pattern for a function's name
CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}   # a function that declares none takes {} (OpenAI's reading)
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolMode(NamedTuple):
    tools: list[dict[str, Any]]     # [{"type": "function", "function": {...}}], as given less null fields
    choice: str                     # none | auto | required | named
    name: str | None                # the named function (choice "named")
    parallel: bool                  # more than one call per answer allowed

    @property
    def shown(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows (the router renders them: text/chat_tools.py); none under choice none."""
        return None if self.choice == "none" else self.tools

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def parameters(self, name: str) -> dict[str, Any]:
        """The JSON schema of a tool's arguments."""
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or NO_PARAMETERS

    def guided_json(self) -> dict[str, Any] | None:
        """The schema the answer is generated in: None for none and auto (free text)."""
        if self.choice == "named":
            return self.parameters(self.name)
        if self.choice != "required":
            return None
        # A tool's local references ("#/$defs/Point": pydantic's nested models) point into its own schema,
        # which sits deeper here: such a schema moves to the root's $defs, its references rebased there.
        defs: dict[str, Any] = {}
        calls = []
        for i, n in enumerate(t["function"]["name"] for t in self.tools):
            arguments = self.parameters(n)
            if (rebased := _rebased(arguments, f"#/$defs/arguments_{i}")) != arguments:   # it has local refs
                defs[f"arguments_{i}"] = rebased
                arguments = {"$ref": f"#/$defs/arguments_{i}"}
            calls.append({"type": "object", "properties": {"name": {"const": n}, "arguments": arguments},
                          "required": ["name", "arguments"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                  "minItems": 1}
        if defs:
            schema["$defs"] = defs
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def _rebased(node: Any, base: str) -> Any:
    """A schema whose local references ("#", "#/…") are made relative to `base`, where it now sits."""
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in SCHEMA_VALUE_KEYS else {n: _rebased(sub, base) for n, sub in v.items()}
           if k in SCHEMA_MAP_KEYS and isinstance(v, dict) else _rebased(v, base) for k, v in node.items()}
    if isinstance(ref := node.get("$ref"), str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def tool_mode(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolMode | None:
    """The request's ToolMode; None when it gives no tools (a tool_choice of none or auto alone is then a no-op,
    as for OpenAI's clients that always send one; required or a named function is a 400)."""
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not tools:
        if tool_choice is not None and tool_choice not in ("none", "auto"):
            raise bad_request("tool_choice", "tool_choice needs tools: give the functions the model may call")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools", "tools must be a list of {\"type\": \"function\", \"function\": {…}}")
    if len(tools) > MAX_TOOLS:
        raise bad_request("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    checked = [_tool(i, t) for i, t in enumerate(tools)]
    seen: set[str] = set()
    for i, t in enumerate(checked):
        name = t["function"]["name"]
        if name in seen:
            raise bad_request(f"tools[{i}].function.name", f"the function name {name!r} is given twice")
        seen.add(name)
    choice, name = _choice(tool_choice, seen)
    mode = ToolMode(checked, choice, name, parallel)
    if mode.choice == "required":
        try:       # each tool's schema compiles; their union may still pass the size limit of a guide
            SamplingParams(guided_json=mode.guided_json())
        except InvalidParameterError as exc:
            raise bad_request("tools", "the tools' schemas together cannot guide a required call: "
                              + str(exc).removeprefix("guided_json: ")) from None
    return mode


def _tool(i: int, t: Any) -> dict[str, Any]:
    at = f"tools[{i}]"
    if not isinstance(t, dict):
        raise bad_request(at, "a tool must be an object {\"type\": \"function\", \"function\": {…}}")
    for key in t:
        if key not in _TOOL_KEYS:
            raise bad_request(f"{at}.{key}", f"Unrecognized request argument supplied: {at}.{key}")
    if t.get("type", "function") != "function":
        raise bad_request(f"{at}.type", f"only function tools are supported, got type {t.get('type')!r}")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{at}.function", "function must be an object with a name")
    for key in fn:
        if key not in _FUNCTION_KEYS:
            raise bad_request(f"{at}.function.{key}", f"Unrecognized request argument supplied: {at}.function.{key}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise bad_request(f"{at}.function.name", "a function name is 1 to 64 letters, digits, underscores or "
                          f"dashes (^[a-zA-Z0-9_-]{{1,64}}$), got {name!r}")
    out: dict[str, Any] = {"name": name}
    if (desc := fn.get("description")) is not None:
        if not isinstance(desc, str):
            raise bad_request(f"{at}.function.description", "description must be a string")
        out["description"] = desc
    if (params := fn.get("parameters")) is not None:
        if not isinstance(params, dict):
            raise bad_request(f"{at}.function.parameters", "parameters must be a JSON schema (an object)")
        try:
            SamplingParams(guided_json=params)
        except InvalidParameterError as exc:
            raise bad_request(f"{at}.function.parameters", str(exc).removeprefix("guided_json: ")) from None
        out["parameters"] = params
    if (strict := fn.get("strict")) is not None:
        if not isinstance(strict, bool):
            raise bad_request(f"{at}.function.strict", "strict must be true or false")
        out["strict"] = strict      # our calls always match the schema under required / named; auto's are read
    return {"type": "function", "function": out}


def _choice(tool_choice: Any, names: set[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise bad_request("tool_choice", f"tool_choice must be none, auto, required or "
                              f"{{\"type\": \"function\", \"function\": {{\"name\": …}}}}, got {tool_choice!r}")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type", "function") != "function" \
            or not isinstance(fn.get("name"), str):
        raise bad_request("tool_choice", "a named tool_choice is {\"type\": \"function\", \"function\": "
                                         "{\"name\": …}}")
    if fn["name"] not in names:
        raise bad_request("tool_choice.function.name", f"tool_choice names {fn['name']!r}, which is not one of "
                          f"the tools ({', '.join(sorted(names))})")
    return "named", fn["name"]
