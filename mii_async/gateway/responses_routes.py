"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}.

A request is answered as one chat completion (openai_params.chat_plan): `instructions` is a system message,
then come the turns that `previous_response_id` ended with (not its instructions, as OpenAI), then `input`
(responses_items.py). `max_output_tokens` is chat's max_tokens; `text.format` (json_object, json_schema)
chat's response_format; function `tools` and `tool_choice` chat's tools; `reasoning.effort` and verbosity go
to the chat template as chat's reasoning_effort and verbosity; `include: ["message.output_text.logprobs"]`
(with `top_logprobs`) asks for logprobs. The answer becomes output items: a "message" with one "output_text",
and a "function_call" item per call (read as chat's are). Refusals name the Responses field
(`max_output_tokens`, `text.format`, `input[2].content`, `tools[0].name`). A stop, or calls made, complete the
response; max_output_tokens leaves it "incomplete" (incomplete_details.reason "max_output_tokens").

`stream: true` answers with server-sent events named as OpenAI's (response.created, response.in_progress, the
items' events, then response.completed, .incomplete or .failed), without [DONE]. `store` (true by default, as
OpenAI's) keeps the response and its conversation (responses_store.py) for GET and for a continuation;
DELETE forgets it. A client that disconnects aborts the request; nothing is stored then.
"""
from __future__ import annotations

import re
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ..errors import GenerationError, MIIAsyncError
from ..outputs import StreamChunk
from .http_errors import HTTPError, bad_request, from_exception
from .openai_logprobs import token_logprobs
from .openai_params import chat_plan, chat_rename
from .openai_routes import check_model
from .openai_schemas import ChatCompletionRequest, ResponsesRequest, lenient_requests
from .responses_items import ResponseEvents, answer_turn, input_messages, item_id, output_items
from .responses_store import ResponseStore, StoredResponse
from .sse import EventStream, until_disconnect
from .state import GatewayState
from .streams import Opened, collect, merge, open_streams
from .text_route import CheckedRoute
from .tool_answer import ToolDeltas, tool_message
from .tool_mode import ToolMode

router = APIRouter(route_class=CheckedRoute, dependencies=[Depends(lenient_requests)])

LOGPROBS = "message.output_text.logprobs"
# OpenAI's includables: only LOGPROBS adds anything here (the others ask for items we never make)
INCLUDABLE = {LOGPROBS, "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content"}
# chat's parameter names → the Responses API's, in errors
_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "reasoning_effort": "reasoning.effort",
          "logprobs": "include", "prompt": "input", "messages": "input", "guided_json": "text.format"}
_STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}   # else (abort): failed
_ABORTED = "the request was aborted before its answer was complete (the deployment is stopping)"


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    s, store = _state(request), _store(request)
    check_model(s, body.model)
    _check(body)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        prev = store.get(body.previous_response_id)
        if prev is None:
            raise HTTPError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                            "invalid_request_error", "previous_response_id", "previous_response_not_found")
        history = prev.conversation
    paths = ["instructions"] if body.instructions is not None else []
    paths += ["previous_response_id"] * len(history)
    turns = input_messages(body.input, paths)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat = _chat_request(body, system + history + turns)
    try:
        jobs, tools = await chat_plan(chat, s)
        opened = await until_disconnect(request, open_streams(s, "responses", jobs))
    except HTTPError as err:
        raise _renamed(err, paths) from None
    except MIIAsyncError as exc:
        raise _renamed(from_exception(exc, chat_rename(chat), counted=True), paths) from None
    base = _response(body, s.model_name)
    answer = _Answer(body, store, base, history + turns, bool(chat.logprobs))
    if body.stream:
        return EventStream(answer.events(opened, tools))
    try:
        chunks = (await until_disconnect(request, collect(opened)))[0]
    except MIIAsyncError as exc:
        raise _renamed(from_exception(exc, chat_rename(chat), counted=True), paths) from None
    last = chunks[-1]
    if last.finish_reason == "error":
        raise from_exception(GenerationError(last.error or "generation failed"), counted=True)
    text = "".join(c.text for c in chunks)
    message, finish = {"role": "assistant", "content": text}, str(last.finish_reason)
    if tools is not None:
        message, finish = tool_message(tools, text, finish)
    lps = token_logprobs([lp for c in chunks for lp in (c.logprobs or [])]) if answer.logprobs else None
    status = _STATUS.get(finish, "failed")
    items = output_items(message, lps, "completed" if status == "completed" else "incomplete")
    return JSONResponse(answer.done(status, items, last, None if status != "failed" else _ABORTED))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    kept = _store(request).get(response_id)
    if kept is None:
        raise _not_found(response_id)
    return JSONResponse(kept.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not _store(request).delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> HTTPError:
    return HTTPError(404, f"No response found with id '{response_id}' (never stored, deleted, or no longer kept)",
                     "invalid_request_error", "response_id", "not_found")


def _check(body: ResponsesRequest) -> None:
    """OpenAI's fields that we take at their neutral values only, and the shapes we read."""
    if body.background:
        raise bad_request("background", "background is not supported: the answer comes with the request")
    if body.truncation not in (None, "disabled"):
        raise bad_request("truncation", f"truncation {body.truncation!r} is not supported: a conversation too "
                          "long for the context is refused (truncation \"disabled\")")
    for key, v in (body.reasoning or {}).items():
        if key not in ("effort", "summary", "generate_summary"):
            raise bad_request(f"reasoning.{key}", f"Unrecognized request argument supplied: reasoning.{key}")
        if key != "effort" and v is not None:
            raise bad_request(f"reasoning.{key}", f"reasoning.{key} is not supported: the model writes no "
                                                  "reasoning apart from its answer")
    for key in body.text or {}:
        if key not in ("format", "verbosity"):
            raise bad_request(f"text.{key}", f"Unrecognized request argument supplied: text.{key}")
    for key in body.stream_options or {}:
        if key != "include_obfuscation":
            raise bad_request(f"stream_options.{key}", f"Unrecognized request argument supplied: stream_options.{key}")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options", "stream_options is only allowed with stream: true")
    for i, name in enumerate(body.include or []):
        if name not in INCLUDABLE:
            raise bad_request(f"include[{i}]", f"include must name one of {', '.join(sorted(INCLUDABLE))}, got "
                                               f"{name!r}")
    if body.max_tool_calls is not None and body.max_tool_calls < 0:
        raise bad_request("max_tool_calls", "max_tool_calls must be at least 0")


def _chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion that answers `body`, over the conversation's `messages`."""
    text = body.text or {}
    fields: dict[str, Any] = {
        "messages": messages, "max_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k, "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty, "service_tier": body.service_tier,
        "tools": _chat_tools(body.tools), "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": _chat_format(text.get("format")),
        "reasoning_effort": (body.reasoning or {}).get("effort"),
        "verbosity": text.get("verbosity", body.verbosity), "chat_template_kwargs": body.chat_template_kwargs}
    if LOGPROBS in (body.include or []) or body.top_logprobs is not None:
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValueError as exc:         # a value of the wrong kind inside text.format, tools or tool_choice
        raise bad_request(None, f"the request cannot be read as a chat: {exc}") from None


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools ({"type": "function", "name", …}) → chat's ({"type": "function", "function": {…}})."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"tools[{i}].type", f"only function tools are supported, got type {kind!r}")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request("tool_choice", "tool_choice is none, auto, required or {\"type\": \"function\", "
                                         "\"name\": …}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _chat_format(fmt: Any) -> dict[str, Any] | None:
    """text.format → chat's response_format."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format", "text.format must be an object {\"type\": …}")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _renamed(err: HTTPError, paths: list[str]) -> HTTPError:
    """A chat-shaped refusal, naming what the Responses request holds: `messages[3].content` → the item it
    came from, `tools[0].function.name` → `tools[0].name`, max_tokens → max_output_tokens, …"""
    old, new = err.param, _param(err.param, paths)
    if old is not None and new != old:
        err.param = new
        err.message = re.sub(rf"(?<![\w.\[]){re.escape(old)}(?![\w\[])", new, err.message)
    for ours, theirs in _NAMES.items():
        if ours not in ("messages", "prompt"):     # plain words too: only the param is renamed
            err.message = re.sub(rf"(?<![\w.]){re.escape(ours)}\b(?![.\[])", theirs, err.message)
    return err


def _param(param: str | None, paths: list[str]) -> str | None:
    if param is None:
        return None
    if m := re.fullmatch(r"messages\[(\d+)\](.*)", param):
        at = paths[int(m[1])] if int(m[1]) < len(paths) else "input"
        return at + m[2] if at.startswith("input[") and m[2].startswith((".content", ".role")) else at
    if m := re.fullmatch(r"(tools\[\d+\])\.function(.*)", param):
        return m[1] + m[2]
    if param == "tool_choice.function.name":
        return "tool_choice.name"
    return _NAMES.get(param, param)


def _response(body: ResponsesRequest, model: str) -> dict[str, Any]:
    """The response object as it starts (status in_progress, no output yet)."""
    text = dict(body.text or {})
    text.setdefault("format", {"type": "text"})
    return {"id": item_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls, "model": model,
            "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "service_tier": "default", "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature, "text": text,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "top_logprobs": body.top_logprobs or 0, "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled", "usage": None, "user": body.user, "metadata": body.metadata or {},
            "prompt_cache_key": body.prompt_cache_key, "safety_identifier": body.safety_identifier}


class _Answer:
    """One request's response object as its answer completes it, stored when asked."""

    def __init__(self, body: ResponsesRequest, store: ResponseStore, base: dict[str, Any],
                 turns: list[dict[str, Any]], logprobs: bool) -> None:
        self.store = store if body.store is not False else None
        self.base = base
        self.turns = turns                  # the conversation before the answer (without the instructions)
        self.logprobs = logprobs

    def done(self, status: str, items: list[dict[str, Any]], last: StreamChunk | None,
             error: str | None = None) -> dict[str, Any]:
        """The response object, final (stored unless it failed); `error`: why it failed."""
        u = last.usage if last is not None else None
        prompt, completion = (u.prompt_tokens, u.completion_tokens) if u is not None else (0, 0)
        response = {**self.base, "status": status, "output": items,
                    "error": {"code": "server_error", "message": error} if error is not None else None,
                    "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                    "usage": {"input_tokens": prompt,
                              "input_tokens_details": {"cached_tokens": u.cached_tokens if u is not None else 0},
                              "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": prompt + completion}}
        if self.store is not None and status in ("completed", "incomplete"):
            self.store.put(response["id"], StoredResponse(response, self.turns + [answer_turn(items)]))
        return response

    async def events(self, opened: list[Opened], tools: ToolMode | None) -> AsyncIterator[str]:
        ev = ResponseEvents()
        yield ev.event("response.created", response=self.base)
        yield ev.event("response.in_progress", response=self.base)
        calls = ToolDeltas(tools) if tools is not None else None
        last: StreamChunk | None = None
        async with aclosing(merge(opened)) as chunks:
            async for _, c in chunks:
                if isinstance(c, Exception) or c.finish_reason == "error":
                    exc = c if isinstance(c, Exception) else GenerationError(c.error or "generation failed")
                    err = from_exception(exc)
                    for e in ev.finish("incomplete"):
                        yield e
                    yield ev.event("response.failed", response={
                        **self.base, "status": "failed", "output": ev.items,
                        "error": {"code": err.code or "server_error", "message": err.message}})
                    return
                deltas = calls.feed(c.text) if calls is not None else [{"content": c.text}]
                if calls is not None and c.finish_reason is not None:
                    deltas += calls.finish(str(c.finish_reason))[0]
                lps = token_logprobs(c.logprobs) if self.logprobs and c.logprobs else None
                for k, d in enumerate(deltas or [{}]):
                    for e in ev.delta(d, lps if k == 0 else None):
                        yield e
                if c.finish_reason is not None:
                    last = c
        status = _STATUS.get(str(last.finish_reason) if last is not None else "abort", "failed")
        for e in ev.finish("completed" if status == "completed" else "incomplete"):
            yield e
        response = self.done(status, ev.items, last, None if status != "failed" else _ABORTED)
        yield ev.event(f"response.{status}", response=response)
