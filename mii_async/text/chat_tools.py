"""A chat with tools → its prompt's text, through the model's chat template; and what the answer's text must
keep for its calls to be read (the reading itself is the gateway's: gateway/tool_parser.py).

The template is given the tools (`apply_chat_template(messages, tools=…)`) and the history's tool calls and
results as Hugging Face's templates expect them: an assistant message's `tool_calls` with `arguments` as an
object, `tool` messages with `tool_call_id`. Many templates ignore all that (the default SmolLM2's prints role
and content only): a template that renders the same text with and without tools is one of those, and then the
tools go into the system message ourselves (tool_section: their JSON and how to call one, the Hermes / Qwen
format that the gateway's parser reads), each earlier call is written into its assistant message as a
`<tool_call>{"name", "arguments"}</tool_call>` block, and tool results come as a user message of
`<tool_response>…</tool_response>` blocks (consecutive results together, so that roles still alternate).

The router's encoder (and the local pipeline's) renders through here, off any event loop (a template over a
long history takes a while); errors name `messages`, `messages[i]…` or `tools[i]…`. Imports no torch.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..errors import InvalidParameterError
from ..guided import GUIDED_FIELDS
from ..params import SamplingParams
from .chat_template import check_messages, render_template
from .unicode_text import check_text

MAX_TOOLS = 128                                    # OpenAI's limit
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
# Tells a template that prints tools from one that does not, when the request gives none (its history has calls)
PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "Tells whether a template shows tools",
                                                "parameters": {"type": "object", "properties": {}}}}


def check_tools(tools: Any) -> None:
    """Tools as a template and the fallback section read them: a list of at most MAX_TOOLS JSON objects
    {"type": "function", "function": {"name": str, …}} (the gateway checks OpenAI's finer rules itself)."""
    if not isinstance(tools, (list, tuple)):
        raise InvalidParameterError("tools", "must be a list of {\"type\": \"function\", \"function\": {…}}")
    if len(tools) > MAX_TOOLS:
        raise InvalidParameterError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or t.get("type", "function") != "function":
            raise InvalidParameterError(f"tools[{i}]", "a tool is {\"type\": \"function\", \"function\": "
                                        "{\"name\": …, \"description\": …, \"parameters\": {…}}}")
        if not _is_json(t):
            raise InvalidParameterError(f"tools[{i}]", "must be JSON: objects with string keys, lists, strings, "
                                        "numbers, booleans and null")
        check_text(f"tools[{i}]", t)


def _is_json(v: Any, depth: int = 0) -> bool:
    """A value JSON (and msgpack, whose maps on our wire take string keys) can carry, nested at most 64 deep."""
    if depth > 64:
        return False
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_json(x, depth + 1) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return all(_is_json(x, depth + 1) for x in v)
    return v is None or isinstance(v, (str, int, float, bool))


def has_tool_calls(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(m, dict) and m.get("tool_calls") for m in messages)


def markers_are_special(tokenizer: Any) -> bool:
    """Whether the tokenizer holds <tool_call> as a special token, which skip_special_tokens would cut out of
    the answer before the parser sees it."""
    return CALL_OPEN in getattr(tokenizer, "all_special_tokens", ())


def keep_call_markers(tools: Any, params: dict[str, Any]) -> bool:
    """Whether an answer is to be read for <tool_call> blocks: tools are shown, the answer is free text (a
    guided one is JSON, not blocks) and the caller's `params` (the keywords as given) name no
    skip_special_tokens."""
    return bool(tools) and "skip_special_tokens" not in params and all(params.get(f) is None for f in GUIDED_FIELDS)


def keeping_markers(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """`params` for an answer read for calls: special tokens kept where the tokenizer holds the markers as
    special tokens (as vLLM's Hermes parser asks), as they were otherwise."""
    if params.skip_special_tokens and markers_are_special(tokenizer):
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                parallel: bool = True, add_generation_prompt: bool = True) -> str:
    """The prompt's text: with `tools` (None: none shown) and the history's calls and results. `parallel`: the
    fallback section allows several calls per answer (else at most one)."""
    check_messages(tokenizer, messages)
    _check_calls(messages)
    if tools is not None:
        check_tools(tools)
    plain = fallback_messages(messages)
    without = render_template(tokenizer, plain, None, add_generation_prompt)
    try:
        knows = render_template(tokenizer, plain, tools or [PROBE_TOOL], add_generation_prompt) != without
    except InvalidParameterError:          # a template that refuses tools does not know them either
        knows = False
    if knows:
        return render_template(tokenizer, messages, tools, add_generation_prompt)
    if not tools:
        return without
    return render_template(tokenizer, with_tool_section(plain, tools, parallel), None, add_generation_prompt)


def _check_calls(messages: list[dict[str, Any]]) -> None:
    """Each earlier call names its function: {"function": {"name": str, "arguments": …}}."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            raise InvalidParameterError(f"messages[{i}].tool_calls", "must be a list")
        for k, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidParameterError(f"messages[{i}].tool_calls[{k}]", "a tool call is {\"function\": "
                                            "{\"name\", \"arguments\"}}")


def tool_section(tools: list[dict[str, Any]], parallel: bool) -> str:
    """What the system message says when the template shows no tools: which there are, and how to call one."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    how = ("You may make several calls, one block each." if parallel else "Make at most one call.")
    return ("# Tools\n\n"
            "You may call functions to help you answer. Their signatures, as JSON schemas, are within "
            f"<tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
            "To call a function, answer with a JSON object of its name and arguments within "
            f"{CALL_OPEN}{CALL_CLOSE} tags:\n{CALL_OPEN}\n{{\"name\": <function name>, \"arguments\": "
            f"<arguments object>}}\n{CALL_CLOSE}\n{how} The results come back within {RESULT_OPEN}{RESULT_CLOSE} tags.")


def with_tool_section(messages: list[dict[str, str]], tools: list[dict[str, Any]],
                      parallel: bool) -> list[dict[str, str]]:
    section = tool_section(tools, parallel)
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{"role": "system", "content": f"{first}\n\n{section}" if first else section}] + messages[1:]
    return [{"role": "system", "content": section}] + messages


def call_block(name: str, arguments: Any) -> str:
    """One call as the fallback prompt writes it (and the gateway's tool_parser.py reads it)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def fallback_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The messages as role and content only: calls as blocks in their assistant message, tool results as a user
    message of <tool_response> blocks."""
    out: list[dict[str, str]] = []
    results: list[str] = []

    def flush() -> None:
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results.clear()

    for m in messages:
        if m["role"] == "tool":
            results.append(f"{RESULT_OPEN}\n{m['content']}\n{RESULT_CLOSE}")
            continue
        flush()
        content = m["content"]
        if m.get("tool_calls"):
            blocks = [call_block(c["function"]["name"], c["function"].get("arguments")) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": m["role"], "content": content})
    flush()
    return out
