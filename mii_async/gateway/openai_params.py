"""OpenAI request bodies → mii_async jobs (prompt + SamplingParams keywords), refusing what we do not do.

Every refusal is a 400 naming the parameter as the caller spelled it. Names differ in two places, mapped back
in errors: max_tokens (ours: max_new_tokens) and min_tokens (ours: min_new_tokens).

A chat travels as its messages, with the tools its prompt shows: the router renders and tokenizes it
(text/chat_tools.py), and fits a chat without max_tokens to the room its prompt leaves; required / named calls
travel as a guided_json schema (tool_mode.py). vLLM's render fields (chat_template_kwargs, with
reasoning_effort and verbosity put there; add_generation_prompt, continue_final_message, add_special_tokens,
truncate_prompt_tokens) travel as the job's RenderOptions (text/render_options.py), sent only when they differ
from the defaults. response_format (either route) and vLLM's structured_outputs become the guided_* fields.
"""
from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidParameterError
from ..guided import GUIDED_FIELDS
from ..params import MAX_LOGPROBS, SamplingParams
from ..text.chat_tools import has_tool_calls
from ..text.render_options import RenderOptions
from .http_errors import bad_request
from .openai_schemas import ChatCompletionRequest, CompletionRequest, _Common
from .state import CHAT_MAX_TOKENS_CAP, GatewayState
from .streams import Job
from .tool_mode import ToolMode, tool_mode

MAX_N = 16
MAX_CHOICES = 1024       # prompts × n of one request: each is an engine request
RENAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
CHAT_RENAME = {**RENAME, "prompt": "messages"}     # a chat's prompt is its messages
# OpenAI's fields that we accept at their neutral values only: (name, those values, why no other)
_NEUTRAL = (("store", (None, False), "nothing is stored on this route (the Responses API stores)"),
            ("modalities", (None, ["text"]), "the model answers in text only"))
SERVICE_TIERS = (None, "auto", "default", "flex", "scale", "priority")   # a label: one tier serves every request
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
VERBOSITIES = ("low", "medium", "high")
# structured_outputs' fields → ours; the refused ones: why
_STRUCTURED = (("json_", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"))
_NO_STRUCTURED = {"grammar": "grammars are not supported (the guides are regular): give json, regex or choice",
                  "structural_tag": "structural tags are not supported: give json, regex or choice",
                  "whitespace_pattern": "the JSON guide's whitespace is fixed",
                  "disable_any_whitespace": "the JSON guide's whitespace is fixed",
                  "disable_additional_properties": "say additionalProperties: false in the schema instead"}
_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _common(body: _Common) -> dict[str, Any]:
    p: dict[str, Any] = {"temperature": 1.0 if body.temperature is None else body.temperature}
    for ours, theirs in (("top_p", "top_p"), ("presence_penalty", "presence_penalty"),
                         ("frequency_penalty", "frequency_penalty"), ("seed", "seed"), ("top_k", "top_k"),
                         ("min_p", "min_p"), ("repetition_penalty", "repetition_penalty"),
                         ("min_new_tokens", "min_tokens"), ("ignore_eos", "ignore_eos"),
                         ("skip_special_tokens", "skip_special_tokens"),
                         ("include_stop_str_in_output", "include_stop_str_in_output"), ("priority", "priority")):
        v = getattr(body, theirs)
        if v is not None:
            p[ours] = v
    if body.stop is not None:
        p["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.stop_token_ids:
        p["stop_token_ids"] = list(body.stop_token_ids)
    if body.allowed_token_ids is not None:
        p["allowed_token_ids"] = list(body.allowed_token_ids)
    if body.logit_bias:
        p["logit_bias"] = [[k, b] for k, b in body.logit_bias.items()]
    for name, neutral, why in _NEUTRAL:
        if (v := getattr(body, name, None)) not in neutral:
            raise bad_request(name, f"{name}={v!r} is not supported: {why}")
    if body.service_tier not in SERVICE_TIERS:
        raise bad_request("service_tier", f"service_tier must be one of {', '.join(map(str, SERVICE_TIERS[1:]))}, "
                                          f"got {body.service_tier!r}")
    for name in GUIDED_FIELDS:
        if (v := getattr(body, name)) is not None:
            p[name] = v
    if body.guided_grammar is not None:
        raise bad_request("guided_grammar", "guided_grammar is not supported (the guides are regular): give "
                                            "guided_json, guided_regex or guided_choice")
    for source, guide in (("structured_outputs", _structured(body)), ("response_format",
                                                                       _response_format(body.response_format))):
        if guide:
            if clash := next((k for k in GUIDED_FIELDS if k in p), None):
                raise bad_request(source, f"give one of {source} and {guide_source(body, clash)}, not both")
            p.update(guide)
    if body.stream_options is not None and not body.stream:    # as OpenAI and vLLM
        raise bad_request("stream_options", "stream_options is only allowed with stream: true")
    if (v := body.prompt_logprobs) is not None:
        if body.stream:        # as vLLM: a chunk has no place for them
            raise bad_request("prompt_logprobs", "prompt_logprobs is not available with stream: true")
        # checked here, as the caller sent it: completions' echo may raise it to logprobs afterwards
        if not 0 <= v <= MAX_LOGPROBS:
            raise bad_request("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {v}")
        p["prompt_logprobs"] = v
    return p


def _structured(body: _Common) -> dict[str, Any]:
    """vLLM's structured_outputs → our guided_* field."""
    so = body.structured_outputs
    if so is None:
        return {}
    for name, why in _NO_STRUCTURED.items():
        if getattr(so, name) not in (None, False):
            raise bad_request(f"structured_outputs.{name}", f"structured_outputs.{name} is not supported: {why}")
    given = [(theirs, ours, v) for theirs, ours in _STRUCTURED if (v := getattr(so, theirs)) is not None]
    if so.json_object:
        given.append(("json_object", "guided_json", {"type": "object"}))
    if len(given) != 1:
        raise bad_request("structured_outputs", "structured_outputs takes exactly one of json, regex, choice and "
                          f"json_object, got {len(given)}")
    theirs, ours, v = given[0]
    try:
        SamplingParams(**{ours: v})
    except InvalidParameterError as exc:
        raise bad_request(f"structured_outputs.{theirs.rstrip('_')}",
                          str(exc).removeprefix(f"{ours}: ")) from None
    return {ours: v}


def guide_source(body: _Common, field: str) -> str:
    """How the caller gave the request's guided_* `field`: by that name, as response_format or as
    structured_outputs.json / .regex / .choice / .json_object."""
    if getattr(body, field, None) is not None:
        return field
    rf = body.response_format
    if field == "guided_json" and isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
        return "response_format"
    so = body.structured_outputs
    if so is not None:
        if field == "guided_json" and so.json_object:
            return "structured_outputs.json_object"
        theirs = next((t for t, ours in _STRUCTURED if ours == field), None)
        if theirs is not None and getattr(so, theirs) is not None:
            return f"structured_outputs.{theirs.rstrip('_')}"
    return field


def render_options(body: _Common, chat: bool) -> RenderOptions:
    """The request's RenderOptions (a chat's template variables get reasoning_effort and verbosity, as vLLM
    gives them, under the caller's own chat_template_kwargs)."""
    fields: dict[str, Any] = {"add_special_tokens": body.add_special_tokens,
                              "truncate_prompt_tokens": body.truncate_prompt_tokens}
    if chat:
        assert isinstance(body, ChatCompletionRequest)
        kwargs: dict[str, Any] = {}
        for name, values in (("reasoning_effort", REASONING_EFFORTS), ("verbosity", VERBOSITIES)):
            if (v := getattr(body, name)) is not None:
                if v not in values:
                    raise bad_request(name, f"{name} must be one of {', '.join(values)}, got {v!r}")
                kwargs[name] = v
        kwargs.update(body.chat_template_kwargs or {})
        fields.update(chat_template_kwargs=kwargs or None, continue_final_message=bool(body.continue_final_message),
                      add_generation_prompt=True if body.add_generation_prompt is None else body.add_generation_prompt)
    try:
        return RenderOptions(**fields)
    except InvalidParameterError as exc:
        raise bad_request(exc.param, str(exc)) from None


def _with_render(options: dict[str, Any], render: RenderOptions) -> dict[str, Any]:
    """client.stream's keywords with `render`, where it is not the defaults (which any router renders so)."""
    return options if render.is_default else {**options, "render": render}


def _response_format(rf: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's response_format → our guided_json: json_object is any JSON object, json_schema its schema."""
    kind = (rf or {}).get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema") if isinstance(rf.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format", "json_schema needs a schema: {\"type\": \"json_schema\", "
                                                 "\"json_schema\": {\"name\": …, \"schema\": {…}}}")
    else:
        raise bad_request("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
    try:
        SamplingParams(guided_json=schema)
    except InvalidParameterError as exc:
        raise bad_request("response_format", str(exc).removeprefix("guided_json: ")) from None
    return {"guided_json": schema}


def _n(body: _Common) -> int:
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise bad_request("n", f"n must be in [1, {MAX_N}], got {n}")
    return n


def chat_rename(body: ChatCompletionRequest) -> dict[str, str]:
    """Our names → the chat request's: max_new_tokens is max_completion_tokens when the caller sent that."""
    if body.max_completion_tokens is not None:
        return {**CHAT_RENAME, "max_new_tokens": "max_completion_tokens"}
    return CHAT_RENAME


def _jobs(prompts: list[Any], params: dict[str, Any], n: int, rename: dict[str, str] = RENAME,
          options: dict[str, Any] | None = None) -> list[Job]:
    """One Job per prompt and choice. `options`: client.stream's keywords beside the sampling parameters (a
    chat's tools, parallel_tool_calls, fit_context), the same for every job."""
    try:
        SamplingParams.from_kwargs(**params)
    except InvalidParameterError as exc:
        from .http_errors import from_exception

        raise from_exception(exc, rename) from None
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request("prompt" if n == 1 else "n", f"{len(prompts)} prompts × n={n} exceeds {MAX_CHOICES} "
                          "choices in one request")
    jobs = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            p = dict(params)
            if n > 1 and p.get("seed") is not None:
                p["seed"] = (p["seed"] + j) % 2**63    # distinct yet reproducible choices (checked above: in range)
            if j > 0:
                # Only a prompt's first choice asks for its prompt logprobs: such a request is computed whole
                # (no prefix-cache hits) and carries a large list; the other choices reuse the first one's
                # (openai_routes._PromptParts), streamed too: open_streams has every choice's first chunk before
                # anything is answered.
                p.pop("prompt_logprobs", None)
            jobs.append(Job(i * n + j, i, prompt, {**p, **(options or {})}))
    return jobs


def completion_jobs(body: CompletionRequest) -> list[Job]:
    if body.suffix:
        raise bad_request("suffix", "suffix is not supported")
    n = _n(body)
    if body.best_of is not None and body.best_of != n:
        raise bad_request("best_of", "best_of other than n is not supported")
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts or any(not p for p in prompts):
        raise bad_request("prompt", "prompt must be a non-empty string, a list of them, or token ids")
    params = _common(body)
    params["max_new_tokens"] = body.max_tokens if body.max_tokens is not None else 16
    if echo_only(body):
        # The prompt (with its logprobs) is the answer, as vLLM scores one: the engine samples one token,
        # which the answer leaves out (openai_routes.py)
        params["max_new_tokens"] = 1
    if body.logprobs is not None:
        params["logprobs"] = body.logprobs
        if body.echo:          # the choice's logprobs cover the echoed prompt's tokens too
            params["prompt_logprobs"] = max(body.logprobs, params.get("prompt_logprobs", 0))
    return _jobs(prompts, params, n, options=_with_render({}, render_options(body, chat=False)))


def echo_only(body: Any) -> bool:
    """A completion that only echoes its prompt: echo with max_tokens 0 (how a client scores a prompt)."""
    return isinstance(body, CompletionRequest) and bool(body.echo) and body.max_tokens == 0


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checks the messages and flattens text content parts; 'developer' is a system message. Each is
    {"role", "content"}, plus for tool calling: an assistant message's `tool_calls` (its content may be null;
    arguments decoded to an object where they are JSON, as chat templates expect them) and a tool message's
    `tool_call_id` and `name`. plain_messages() drops those again."""
    if not messages:
        raise bad_request("messages", "messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise bad_request(f"messages[{i}].role", f"role must be one of {', '.join(sorted(_ROLES))}, got {role!r}")
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content[{k}]", "only text content parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content", "content must be a string or a list of text parts")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
            if calls := _tool_calls(i, m["tool_calls"]):
                msg["tool_calls"] = calls
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if (v := m.get(key)) is not None:
                    if not isinstance(v, str):
                        raise bad_request(f"messages[{i}].{key}", f"{key} must be a string")
                    msg[key] = v
        out.append(msg)
    return out


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, for the chat template: arguments as an object where they are JSON
    (a model's arguments that are not stay text)."""
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls", "tool_calls must be a list")
    out = []
    for k, c in enumerate(calls):
        at = f"messages[{i}].tool_calls[{k}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise bad_request(at, "a tool call is {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                                  "\"arguments\"}}")
        if c.get("type", "function") != "function":
            raise bad_request(f"{at}.type", f"only function calls are supported, got type {c.get('type')!r}")
        fn = c["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"{at}.function.name", "a tool call names its function")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        elif not isinstance(args, dict):
            raise bad_request(f"{at}.function.arguments", "arguments must be the JSON text of an object")
        call: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if (cid := c.get("id")) is not None:
            if not isinstance(cid, str):
                raise bad_request(f"{at}.id", "id must be a string")
            call = {"id": cid, **call}
        out.append(call)
    return out


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The messages of a chat without tools or calls, as its template gets them: role and content only."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


async def chat_jobs(body: ChatCompletionRequest, state: GatewayState) -> list[Job]:
    return (await chat_plan(body, state))[0]


async def chat_plan(body: ChatCompletionRequest, state: GatewayState) -> tuple[list[Job], ToolMode | None]:
    """The request's jobs, and the ToolMode its answers are read under (None: plain text)."""
    for legacy in ("functions", "function_call"):
        if getattr(body, legacy) is not None:
            raise bad_request(legacy, f"{legacy} (the legacy function calling) is not supported: give the functions "
                              "as tools, and tool_choice instead of function_call")
    n = _n(body)
    messages = chat_messages(body.messages)
    mode = tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls)
    params = _common(body)
    render = render_options(body, chat=True)
    if mode is not None:
        if clash := next((k for k in GUIDED_FIELDS if k in params), None):
            if (source := guide_source(body, clash)) == "response_format":
                raise bad_request("response_format", "response_format json_object / json_schema cannot be "
                                                     "combined with tools")
            raise bad_request(source, f"{source} cannot be combined with tools")
        if (schema := mode.guided_json()) is not None:
            params["guided_json"] = schema
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    options: dict[str, Any] = {}
    if (mode is not None and mode.choice != "none") or has_tool_calls(messages):
        # The router renders the tools and the history's calls (text/chat_tools.py). Under auto the client asks
        # it to keep the <tool_call> markers that tool_parser.py reads, where the tokenizer holds them as
        # special tokens, unless the caller named skip_special_tokens.
        prompt: Any = messages
        if mode is not None:
            options.update(tools=mode.shown, parallel_tool_calls=mode.parallel)
        await state.check_size(messages, mode.tools if mode is not None else None)
    else:
        prompt = plain_messages(messages)
        if max_tokens is None:
            await state.check_size(prompt)
    if max_tokens is None:
        # As OpenAI and vLLM: what the context (and the KV pool) leaves after the prompt, which the router
        # counts once it has the ids, up to CHAT_MAX_TOKENS_CAP.
        params["max_new_tokens"], options["fit_context"] = CHAT_MAX_TOKENS_CAP, True
    else:
        params["max_new_tokens"] = max_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise bad_request("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}")
    if body.logprobs:
        params["logprobs"] = body.top_logprobs or 0
    return (_jobs([prompt], params, n, chat_rename(body), _with_render(options, render)),
            mode if mode is not None and mode.choice != "none" else None)

