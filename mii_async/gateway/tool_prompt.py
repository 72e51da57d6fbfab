"""A chat with tools → its prompt, through the model's chat template, in the gateway (the router's templates know
no tools; it gets the token ids).

The template is given the tools (`apply_chat_template(messages, tools=…)`) and the history's tool calls and
results as Hugging Face's templates expect them: an assistant message's `tool_calls` with `arguments` as an
object, `tool` messages with `tool_call_id`. Many templates ignore all that (the default SmolLM2's prints role
and content only): a template that renders the same text with and without tools is one of those, and then the
tools go into the system message ourselves (tool_section: their JSON and how to call one, the Hermes / Qwen
format that tool_parser.py reads), each earlier call is written into its assistant message as a
`<tool_call>{"name", "arguments"}</tool_call>` block, and tool results come as a user message of
`<tool_response>…</tool_response>` blocks (consecutive results together, so that roles still alternate).

Runs off the event loop (a template over a long history, then the tokenizer); errors name `messages`.
"""
from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidParameterError
from ..text.prompts import MAX_MESSAGES, render_template
from .tool_mode import ToolMode
from .tool_parser import CLOSE, OPEN

RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
# Tells a template that prints tools from one that does not, when the request gives none (its history has calls)
PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "Tells whether a template shows tools",
                                                "parameters": {"type": "object", "properties": {}}}}


def markers_are_special(tokenizer: Any) -> bool:
    """Whether the tokenizer holds <tool_call> as a special token, which skip_special_tokens would cut out of
    the answer before the parser sees it (auto then keeps special tokens, as vLLM's Hermes parser does)."""
    return OPEN in getattr(tokenizer, "all_special_tokens", ())


def has_tool_calls(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") for m in messages)


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], mode: ToolMode | None,
                add_generation_prompt: bool = True) -> list[int]:
    """The token ids of the prompt (the template holds the special tokens: none are added)."""
    text = render_chat(tokenizer, messages, mode, add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], mode: ToolMode | None,
                add_generation_prompt: bool = True) -> str:
    """The prompt's text: with the tools unless tool_choice is none, and the history's calls and results."""
    if len(messages) > MAX_MESSAGES:
        raise InvalidParameterError("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidParameterError("messages", "this model's tokenizer has no chat template")
    tools = mode.tools if mode is not None and mode.choice != "none" else None
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
    return render_template(tokenizer, with_tool_section(plain, tools, mode.parallel), None, add_generation_prompt)


def tool_section(tools: list[dict[str, Any]], parallel: bool) -> str:
    """What the system message says when the template shows no tools: which there are, and how to call one."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    how = ("You may make several calls, one block each." if parallel else "Make at most one call.")
    return ("# Tools\n\n"
            "You may call functions to help you answer. Their signatures, as JSON schemas, are within "
            f"<tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
            "To call a function, answer with a JSON object of its name and arguments within "
            f"{OPEN}{CLOSE} tags:\n{OPEN}\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n"
            f"{CLOSE}\n{how} The results come back within {RESULT_OPEN}{RESULT_CLOSE} tags.")


def with_tool_section(messages: list[dict[str, str]], tools: list[dict[str, Any]],
                      parallel: bool) -> list[dict[str, str]]:
    section = tool_section(tools, parallel)
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{"role": "system", "content": f"{first}\n\n{section}" if first else section}] + messages[1:]
    return [{"role": "system", "content": section}] + messages


def call_block(name: str, arguments: Any) -> str:
    """One call as the fallback prompt writes it (and tool_parser.py reads it)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


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
            blocks = [call_block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": m["role"], "content": content})
    flush()
    return out
