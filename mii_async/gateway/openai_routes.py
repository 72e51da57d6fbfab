"""OpenAI-compatible routes: GET /v1/models and /v1/models/{model}, POST /v1/completions and
/v1/chat/completions.

`stream: true` answers with server-sent events, one chunk per streamed step of each choice, then (with
`stream_options.include_usage`) a usage chunk whose `choices` is empty, then `data: [DONE]` (vLLM's
`continuous_usage_stats` adds the usage so far to every chunk). A refused request is answered before any
event (400 / 404 / 503 in OpenAI's error format); an error in the middle of a stream is sent as
`data: {"error": …}`, then `[DONE]`. A client that disconnects aborts its requests.

Prompt logprobs, two ways: completions' `echo` with `logprobs: n` (OpenAI's) puts the echoed prompt's tokens
first in the choice's logprobs, the first one's logprob and top null (streamed: in the first chunk, with the
echoed text); vLLM's `prompt_logprobs: n` (either route, not streamed) adds vLLM's `prompt_logprobs` list —
per choice on completions, once for the response on chat. Of the n choices of a prompt only the first asks the
engine for them (such a request skips the prefix cache); every choice's answer shows that one result, rendered
once per prompt (openai_logprobs.PromptParts). The tokens' texts and bytes come with the chunks (the router
decodes them): the gateway decodes no token id for logprobs.

Tool calls (chat with `tools`): each choice's answer is read under the request's ToolMode (tool_answer.py) into
`message.tool_calls`, whole or as `tool_calls` deltas; the choice's other chunks are as without tools.

vLLM's answer-shaping fields (_Shape): return_tokens_as_token_ids names logprobs' tokens "token_id:{id}";
completions' echo with max_tokens 0 answers the prompt alone (the one sampled token left out, no completion
tokens counted); chat's echo starts the answer with the last message's content when it is the assistant's.
"""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, NamedTuple

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ..errors import GenerationError, MIIAsyncError
from ..outputs import StreamChunk
from .http_errors import HTTPError, from_exception
from .openai_logprobs import PromptParts, chat_logprobs, decodes_echo, end_offset, extend, text_logprobs
from .openai_params import (CHAT_RENAME, RENAME, chat_plan, chat_rename, completion_jobs, echo_only,
                            guide_source)
from .openai_schemas import ChatCompletionRequest, CompletionRequest, lenient_requests
from .sse import DONE, EventStream, event, until_disconnect
from .state import GatewayState
from .streams import Job, Opened, collect, merge, open_streams
from .text_route import CheckedRoute
from .tool_answer import ToolDeltas, stream_choices, tool_message
from .tool_mode import ToolMode

router = APIRouter(route_class=CheckedRoute, dependencies=[Depends(lenient_requests)])


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


def check_model(state: GatewayState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise HTTPError(404, f"The model '{model}' does not exist; this server serves '{state.model_name}'",
                        "not_found_error", "model", "model_not_found")


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> dict:
    """One model, as the `openai` package's models.retrieve() asks; 404 for any other name."""
    s = _state(request)
    check_model(s, model)
    return _model_card(s)


def _model_card(s: GatewayState) -> dict:
    return {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "mii_async"}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    s = _state(request)
    check_model(s, body.model)
    return await _answer(s, request, "completions", completion_jobs(body), body, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    s = _state(request)
    check_model(s, body.model)
    try:
        jobs, tools = await chat_plan(body, s)
    except MIIAsyncError as exc:
        raise from_exception(exc, chat_rename(body)) from None
    return await _answer(s, request, "chat", jobs, body, chat=True, tools=tools, rename=_chat_rename(body, tools))


def _chat_rename(body: ChatCompletionRequest, tools: ToolMode | None) -> dict[str, str]:
    """Our names → the chat request's: a guide the replica refuses is named as the caller gave it."""
    rename = {**chat_rename(body), **_guide_rename(body)}
    if tools is not None and tools.guided_json() is not None:
        rename["guided_json"] = "tools"
    return rename


def _guide_rename(body: Any) -> dict[str, str]:
    """The guided_* fields as the caller gave them (response_format, structured_outputs.json, …)."""
    return {f: source for f in ("guided_json", "guided_regex", "guided_choice")
            if (source := guide_source(body, f)) != f}


def _chat_echo(body: Any) -> str:
    """vLLM's chat echo: the answer starts with the last message's content, when that message is the
    assistant's (the turn that continue_final_message continues)."""
    if not getattr(body, "echo", False) or not isinstance(body, ChatCompletionRequest):
        return ""
    last = body.messages[-1] if body.messages else {}
    content = last.get("content") if last.get("role") == "assistant" else None
    if isinstance(content, list):            # text parts (openai_params.chat_messages checked them)
        content = "".join(part["text"] for part in content)
    return content if isinstance(content, str) else ""


async def _answer(s: GatewayState, request: Request, api: str, jobs: list[Job], body: Any, chat: bool,
                  tools: ToolMode | None = None, rename: dict[str, str] | None = None):
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": s.model_name}
    rename = rename or (CHAT_RENAME if chat else {**RENAME, **_guide_rename(body)})
    if not chat and body.echo and any(decodes_echo(j) for j in jobs):
        await s.load_tokenizer()        # the echoed text of token ids (or a cut prompt): the one use of it here
    as_ids = bool(body.return_tokens_as_token_ids)
    only_echo, chat_echo = echo_only(body), _chat_echo(body)
    try:
        opened = await until_disconnect(request, open_streams(s, api, jobs))
    except MIIAsyncError as exc:
        raise from_exception(exc, rename, counted=True) from None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = include_usage and bool(body.stream_options.continuous_usage_stats)
        return EventStream(_events(s, opened, meta, chat, include_usage, bool(getattr(body, "echo", False)),
                                   None if chat else body.logprobs, tools, continuous, rename,
                                   _Shape(as_ids, only_echo, chat_echo)))
    try:
        chunks = await until_disconnect(request, collect(opened))
    except MIIAsyncError as exc:
        raise from_exception(exc, rename, counted=True) from None
    choices, usage = [], _Usage(count_completion=not only_echo)
    answer: dict[str, Any] = {}
    parts = PromptParts(s, opened, as_ids)
    for o in opened:
        cs = chunks[o.job.index]
        last = cs[-1]
        if last.finish_reason == "error":
            raise from_exception(GenerationError(last.error or "generation failed"), counted=True)
        usage.add(o.job, last)
        text = "".join(c.text for c in cs) if not only_echo else ""
        lps = [lp for c in cs for lp in (c.logprobs or [])] if not only_echo else []
        want_lp = o.job.params.get("logprobs") is not None
        finish = last.finish_reason if not only_echo else "length"
        if chat:
            message = {"role": "assistant", "content": text}
            if tools is not None:
                message, finish = tool_message(tools, text, finish)
            if chat_echo and isinstance(message.get("content"), str):
                message["content"] = chat_echo + message["content"]
            choices.append({"index": o.job.index, "message": message,
                            "logprobs": chat_logprobs(lps, as_ids) if want_lp else None, "finish_reason": finish})
            if body.prompt_logprobs is not None and answer.get("prompt_logprobs") is None:
                # vLLM's place: once for the response, whose choices share the prompt
                answer["prompt_logprobs"] = parts.vllm(o.job, body.prompt_logprobs)
        else:
            logprobs = None
            if body.echo:
                text = parts.text(o.job) + text
                if want_lp:
                    logprobs = {k: list(v) for k, v in parts.echo(o.job, body.logprobs).items()}  # extended below
                    extend(logprobs, text_logprobs(lps, end_offset(logprobs), as_ids=as_ids))
            elif want_lp:
                logprobs = text_logprobs(lps, 0, as_ids=as_ids)
            choice = {"index": o.job.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if body.prompt_logprobs is not None:        # vLLM's place: per choice (the prompt's one list, shared)
                choice["prompt_logprobs"] = parts.vllm(o.job, body.prompt_logprobs)
            choices.append(choice)
    # A Response, not a dict: FastAPI would walk a returned dict with jsonable_encoder first, which took 6.7 s
    # for one choice with a 39k-token prompt's logprobs at n = 20 (json.dumps alone: 1.6 s). The body is plain
    # JSON types already.
    return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                         "usage": usage.body(), "system_fingerprint": None, **answer})


class _Shape(NamedTuple):
    """How a request's answer shows besides its sampled text (vLLM's fields)."""
    as_ids: bool = False            # return_tokens_as_token_ids: logprobs' tokens as "token_id:{id}"
    echo_only: bool = False         # completions' echo with max_tokens 0: the prompt alone, nothing generated
    chat_echo: str = ""             # chat's echo: the text the answer starts with


async def _events(s: GatewayState, opened: list[Opened], meta: dict, chat: bool, include_usage: bool,
                  echo: bool, echo_logprobs: int | None, tools: ToolMode | None = None,
                  continuous: bool = False, rename: dict[str, str] = RENAME,
                  shape: _Shape = _Shape()) -> AsyncIterator[str]:
    """`continuous` (vLLM's stream_options.continuous_usage_stats): every chunk carries the usage so far."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}
    usage = _Usage(count_completion=not shape.echo_only)
    for o in opened:
        usage.saw_prompt(o.job, o.first)
    offsets = {o.job.index: 0 for o in opened}
    answers = {o.job.index: ToolDeltas(tools) for o in opened} if tools is not None else {}   # each its own

    def chunk(choice: dict) -> str:
        return event({**meta, "object": obj, "choices": [choice], **(
            {"usage": usage.so_far()} if continuous else extra)})

    if chat:
        for o in opened:
            yield chunk({"index": o.job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
            if shape.chat_echo:
                yield chunk({"index": o.job.index, "delta": {"content": shape.chat_echo}, "logprobs": None,
                             "finish_reason": None})
    elif echo:
        parts = PromptParts(s, opened, shape.as_ids)
        for o in opened:           # the prompt, with its logprobs when asked: the first chunks have them already
            text = parts.text(o.job)
            lp = parts.echo(o.job, echo_logprobs) if echo_logprobs is not None else None
            offsets[o.job.index] = end_offset(lp) if lp is not None else len(text)
            yield chunk({"index": o.job.index, "text": text, "logprobs": lp, "finish_reason": None})
    async with aclosing(merge(opened)) as items:
        async for job, c in items:
            if isinstance(c, Exception):
                usage.failed(job)
                yield _error_event(c, rename)
                continue
            usage.saw(job, c)
            if c.finish_reason == "error":
                usage.failed(job)
                yield _error_event(GenerationError(c.error or "generation failed"), rename)
                continue
            want_lp = job.params.get("logprobs") is not None and c.logprobs
            if shape.echo_only:    # the prompt was the answer: the sampled token is left out, and ends it
                if c.finish_reason is not None:
                    yield chunk({"index": job.index, "text": "", "logprobs": None, "finish_reason": "length"})
            elif answers:
                for choice in stream_choices(answers[job.index], job.index, c.text, c.finish_reason,
                                             chat_logprobs(c.logprobs, shape.as_ids) if want_lp else None):
                    yield chunk(choice)
            elif chat:
                delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                yield chunk({"index": job.index, "delta": delta,
                             "logprobs": chat_logprobs(c.logprobs, shape.as_ids) if want_lp else None,
                             "finish_reason": c.finish_reason})
            else:
                lp = text_logprobs(c.logprobs, offsets[job.index], as_ids=shape.as_ids) if want_lp else None
                offsets[job.index] += len(c.text)
                yield chunk({"index": job.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
            if c.finish_reason is not None:
                usage.add(job, c)
    if include_usage:
        yield event({**meta, "object": obj, "choices": [], "usage": usage.body()})
    yield DONE


def _error_event(exc: Exception, rename: dict[str, str]) -> str:
    return event(from_exception(exc, rename).body())


class _Usage:
    def __init__(self, count_completion: bool = True) -> None:
        """`count_completion` false: an answer of the prompt alone (echo_only) counts no completion tokens."""
        self.count_completion = count_completion
        self.prompt, self.completion, self.cached, self.seen = 0, 0, 0, set()
        self.streamed: dict[int, int] = {}        # tokens streamed per choice, for one that ends in an error
        self.prompt_lens: dict[int, int] = {}     # per prompt, from a first chunk's prompt ids

    def saw(self, job: Job, c: StreamChunk) -> None:
        if self.count_completion:
            self.streamed[job.index] = self.streamed.get(job.index, 0) + len(c.token_ids)
        self.saw_prompt(job, c)

    def saw_prompt(self, job: Job, c: StreamChunk) -> None:
        if c.prompt_token_ids:
            self.prompt_lens.setdefault(job.prompt_index, len(c.prompt_token_ids))

    def so_far(self) -> dict:
        prompt, completion = sum(self.prompt_lens.values()), sum(self.streamed.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def failed(self, job: Job) -> None:
        """A choice that ended in an error counts what it streamed (and its prompt, if a chunk came)."""
        self.completion += self.streamed.get(job.index, 0)
        if job.prompt_index not in self.seen and job.prompt_index in self.prompt_lens:
            self.seen.add(job.prompt_index)
            self.prompt += self.prompt_lens[job.prompt_index]

    def add(self, job: Job, last: StreamChunk) -> None:
        u = last.usage
        if u is None:
            return
        self.completion += u.completion_tokens if self.count_completion else 0
        if job.prompt_index not in self.seen:     # n choices of one prompt count its tokens once
            self.seen.add(job.prompt_index)
            self.prompt += u.prompt_tokens
            self.cached += u.cached_tokens

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached}}
