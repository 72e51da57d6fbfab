"""What a client's request is on the wire and what its answers become: a request's parameters checked into
SamplingParams, its Generate fields and its prompt (naming the parameter at fault, before anything is sent),
and a Delta read into the StreamChunk callers get."""
from __future__ import annotations

import itertools
from typing import Any

from . import protocol as P
from .errors import InvalidParameterError
from .mii_params import check_max_length, check_names, length_request
from .outputs import Logprob, StreamChunk, Usage
from .params import SamplingParams
from .text.chat_tools import check_tools, keep_call_markers
from .text.prompts import check_token_ids, is_messages, is_token_ids
from .text.render_options import RenderOptions
from .text.unicode_text import check_text


def checked_request(params: dict[str, Any], max_length: Any, tools: Any, parallel_tool_calls: Any,
             fit_context: Any, render: Any = None) -> tuple[SamplingParams, dict[str, Any]]:
    """A request's sampling parameters and Generate fields, checked here, naming the parameter (the router
    checks again). `max_length` (DeepSpeed-MII's) asks the router for the room it leaves (mii_params.py)."""
    check_names(params)
    if max_length is not None:
        params, fit_context = length_request(params, check_max_length(max_length)), True
    sp = SamplingParams.from_kwargs(**params)
    return sp, {**generate_fields(params, tools, parallel_tool_calls, fit_context),
                **RenderOptions.coerce(render).to_wire()}


def generate_fields(params: dict[str, Any], tools: Any, parallel_tool_calls: Any,
                     fit_context: Any) -> dict[str, Any]:
    """A Generate's fields beside the prompt and `params` (the sampling keywords as given), checked here, where
    the caller can be named: msgpack could not carry a malformed tool."""
    if tools is not None:
        check_tools(tools)
    for name, v in (("parallel_tool_calls", parallel_tool_calls), ("fit_context", fit_context)):
        if not isinstance(v, bool):
            raise InvalidParameterError(name, "must be true or false")
    return {"tools": None if tools is None else list(tools), "parallel_tool_calls": parallel_tool_calls,
            "keep_tool_markers": keep_call_markers(tools, params), "fit_context": fit_context}


def put_prompt(msg: P.Generate, prompt: Any) -> None:
    """Sets the Generate's prompt, prompt_ids or messages from `prompt` (text, token ids or chat messages),
    checked for what the wire carries, naming the parameter."""
    if msg.tools is not None and not is_messages(prompt):
        raise InvalidParameterError("tools", "tools go with a chat: give the prompt as messages")
    if isinstance(prompt, str):
        check_text("prompt", prompt)                 # msgpack could not carry it
        msg.prompt = prompt
    elif is_token_ids(prompt):
        check_token_ids(prompt)
        msg.prompt_ids = list(prompt)
    elif is_messages(prompt):
        msg.messages = [dict(m) for m in prompt]
        for i, m in enumerate(msg.messages):
            check_text(f"messages[{i}]", m)
            if not all(isinstance(k, str) for k in m):   # msgpack's maps on the wire take string keys
                raise InvalidParameterError(f"messages[{i}]", "keys must be strings")
    else:
        raise InvalidParameterError("prompt", "must be a string, a list of token ids or a list of chat messages")


def usage_of(u: dict | None) -> Usage | None:
    if u is None:
        return None
    return Usage(u["prompt_tokens"], u["completion_tokens"], u.get("cached_tokens", 0))


def chunk_of(d: P.Delta) -> StreamChunk:
    texts = d.token_texts
    lps = list(map(Logprob.from_wire, d.token_ids, d.logprobs, itertools.repeat(texts))) if d.logprobs else None
    plps = d.prompt_logprobs.to_logprobs(d.prompt_ids, texts) if d.prompt_logprobs is not None else None
    return StreamChunk(d.text, list(d.token_ids), lps, d.finish_reason, usage_of(d.usage), d.error, plps,
                       d.prompt_ids, texts)
