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
once per prompt (_PromptParts). The tokens' texts and bytes come with the chunks (the router decodes them): the
gateway decodes no token id for logprobs.

Tool calls (chat with `tools`): each choice's answer is read under the request's ToolMode (tool_answer.py) into
`message.tool_calls`, whole or as `tool_calls` deltas; the choice's other chunks are as without tools.
"""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..errors import GenerationError, MIIAsyncError
from ..outputs import Logprob, StreamChunk, TokenTexts
from .http_errors import HTTPError, from_exception
from .openai_params import CHAT_RENAME, RENAME, chat_plan, chat_rename, completion_jobs
from .openai_schemas import ChatCompletionRequest, CompletionRequest
from .sse import DONE, EventStream, event, until_disconnect
from .state import GatewayState
from .streams import Job, Opened, collect, merge, open_streams
from .text_route import CheckedRoute
from .tool_answer import ToolDeltas, stream_choices, tool_message
from .tool_mode import ToolMode

router = APIRouter(route_class=CheckedRoute)


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
    rename = dict(chat_rename(body))
    if isinstance(body.response_format, dict) and body.response_format.get("type") in ("json_object", "json_schema"):
        rename["guided_json"] = "response_format"
    elif tools is not None and tools.guided_json() is not None:
        rename["guided_json"] = "tools"
    return rename


async def _answer(s: GatewayState, request: Request, api: str, jobs: list[Job], body: Any, chat: bool,
                  tools: ToolMode | None = None, rename: dict[str, str] | None = None):
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": s.model_name}
    rename = rename or (CHAT_RENAME if chat else RENAME)
    if getattr(body, "echo", False) and any(not isinstance(j.prompt, str) for j in jobs):
        await s.load_tokenizer()        # the echoed text of a token-id prompt: the one use of it here
    try:
        opened = await until_disconnect(request, open_streams(s, api, jobs))
    except MIIAsyncError as exc:
        raise from_exception(exc, rename, counted=True) from None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = include_usage and bool(body.stream_options.continuous_usage_stats)
        return EventStream(_events(s, opened, meta, chat, include_usage, bool(getattr(body, "echo", False)),
                                   None if chat else body.logprobs, tools, continuous, rename))
    try:
        chunks = await until_disconnect(request, collect(opened))
    except MIIAsyncError as exc:
        raise from_exception(exc, rename, counted=True) from None
    choices, usage = [], _Usage()
    answer: dict[str, Any] = {}
    parts = _PromptParts(s, opened)
    for o in opened:
        cs = chunks[o.job.index]
        last = cs[-1]
        if last.finish_reason == "error":
            raise from_exception(GenerationError(last.error or "generation failed"), counted=True)
        usage.add(o.job, last)
        text = "".join(c.text for c in cs)
        lps = [lp for c in cs for lp in (c.logprobs or [])]
        want_lp = o.job.params.get("logprobs") is not None
        if chat:
            message, finish = {"role": "assistant", "content": text}, last.finish_reason
            if tools is not None:
                message, finish = tool_message(tools, text, finish)
            choices.append({"index": o.job.index, "message": message,
                            "logprobs": _chat_logprobs(lps) if want_lp else None, "finish_reason": finish})
            if body.prompt_logprobs is not None and answer.get("prompt_logprobs") is None:
                # vLLM's place: once for the response, whose choices share the prompt
                answer["prompt_logprobs"] = parts.vllm(o.job, body.prompt_logprobs)
        else:
            logprobs = None
            if body.echo:
                text = parts.text(o.job) + text
                if want_lp:
                    logprobs = {k: list(v) for k, v in parts.echo(o.job, body.logprobs).items()}  # extended below
                    _extend(logprobs, _text_logprobs(lps, _end_offset(logprobs)))
            elif want_lp:
                logprobs = _text_logprobs(lps, 0)
            choice = {"index": o.job.index, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason}
            if body.prompt_logprobs is not None:        # vLLM's place: per choice (the prompt's one list, shared)
                choice["prompt_logprobs"] = parts.vllm(o.job, body.prompt_logprobs)
            choices.append(choice)
    # A Response, not a dict: FastAPI would walk a returned dict with jsonable_encoder first, which took 6.7 s
    # for one choice with a 39k-token prompt's logprobs at n = 20 (json.dumps alone: 1.6 s). The body is plain
    # JSON types already.
    return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                         "usage": usage.body(), "system_fingerprint": None, **answer})


async def _events(s: GatewayState, opened: list[Opened], meta: dict, chat: bool, include_usage: bool,
                  echo: bool, echo_logprobs: int | None, tools: ToolMode | None = None,
                  continuous: bool = False, rename: dict[str, str] = RENAME) -> AsyncIterator[str]:
    """`continuous` (vLLM's stream_options.continuous_usage_stats): every chunk carries the usage so far."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}
    usage = _Usage()
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
    elif echo:
        parts = _PromptParts(s, opened)
        for o in opened:           # the prompt, with its logprobs when asked: the first chunks have them already
            text = parts.text(o.job)
            lp = parts.echo(o.job, echo_logprobs) if echo_logprobs is not None else None
            offsets[o.job.index] = _end_offset(lp) if lp is not None else len(text)
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
            if answers:
                for choice in stream_choices(answers[job.index], job.index, c.text, c.finish_reason,
                                             _chat_logprobs(c.logprobs) if want_lp else None):
                    yield chunk(choice)
            elif chat:
                delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                yield chunk({"index": job.index, "delta": delta,
                             "logprobs": _chat_logprobs(c.logprobs) if want_lp else None,
                             "finish_reason": c.finish_reason})
            else:
                lp = _text_logprobs(c.logprobs, offsets[job.index]) if want_lp else None
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
    def __init__(self) -> None:
        self.prompt, self.completion, self.cached, self.seen = 0, 0, 0, set()
        self.streamed: dict[int, int] = {}        # tokens streamed per choice, for one that ends in an error
        self.prompt_lens: dict[int, int] = {}     # per prompt, from a first chunk's prompt ids

    def saw(self, job: Job, c: StreamChunk) -> None:
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
        self.completion += u.completion_tokens
        if job.prompt_index not in self.seen:     # n choices of one prompt count its tokens once
            self.seen.add(job.prompt_index)
            self.prompt += u.prompt_tokens
            self.cached += u.cached_tokens

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached}}


class _PromptParts:
    """What the choices of one prompt share, rendered once per prompt: its echoed text and its logprobs, in
    OpenAI's shape (echo) and in vLLM's (prompt_logprobs). The logprobs come from the first chunk of the
    prompt's choice that asked for them (only its first one does: openai_params._jobs); the answers share the
    returned objects, so a caller that changes one copies it first."""

    def __init__(self, s: GatewayState, opened: list[Opened]) -> None:
        self.s = s
        self.firsts: dict[int, StreamChunk] = {}
        for o in opened:
            if "prompt_logprobs" in o.job.params:
                self.firsts.setdefault(o.job.prompt_index, o.first)
        self._done: dict[tuple, Any] = {}

    def _once(self, key: tuple, make: Any) -> Any:
        if key not in self._done:
            self._done[key] = make()
        return self._done[key]

    def _first(self, job: Job) -> StreamChunk | None:
        return self.firsts.get(job.prompt_index)

    def text(self, job: Job) -> str:
        return self._once(("text", job.prompt_index), lambda: _prompt_text(self.s, job.prompt))

    def echo(self, job: Job, n: int) -> dict:
        return self._once(("echo", job.prompt_index, n), lambda: _echo_logprobs(self._first(job), n))

    def vllm(self, job: Job, n: int) -> list | None:
        return self._once(("vllm", job.prompt_index, n), lambda: _vllm_prompt_logprobs(self._first(job), n))


def _prompt_text(s: GatewayState, prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return s.tokenizer.decode(prompt) if s.tokenizer is not None else ""


def _text_logprobs(lps: list[Logprob | None], offset: int, ids: list[int] | None = None,
                   texts: TokenTexts | None = None, n: int | None = None) -> dict:
    """The completions API's logprobs: tokens, token_logprobs, top_logprobs, text_offset (each token's start,
    counted from `offset` over the tokens' texts, as vLLM does). An entry without a logprob (a prompt's first
    token) is null in token_logprobs and top_logprobs; its id comes from `ids` (the ids of every entry, when
    given, with `texts`, their chunk's). `n` cuts the top lists (a prompt's may hold more than the completion's
    logprobs asked)."""
    if ids is None:
        tokens = [lp.text for lp in lps]
    else:
        assert texts is not None, "a prompt's ids come with their chunk's token_texts"
        tokens = [texts.text(i) for i in ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [None if lp is None else _top(lp, t, n) for lp, t in zip(lps, tokens)],
            "text_offset": offsets}


def _top(lp: Logprob, token: str, n: int | None) -> dict[str, float]:
    """A token's top_logprobs entry: the top n, and the token itself if it is not among them (as OpenAI and
    vLLM: up to logprobs + 1 entries, so logprobs=0 still gives the chosen token's)."""
    assert lp.token_texts is not None, "a chunk's logprobs come with their texts"
    text = lp.token_texts.text
    top = {text(i): v for i, v in lp.top[:n]}
    top.setdefault(token, lp.logprob)
    return top


def _echo_logprobs(first: StreamChunk | None, n: int) -> dict:
    """The echoed prompt's part of a choice's logprobs, from the stream's first chunk (OpenAI's echo with
    logprobs: the first prompt token has null logprobs); empty if the request ended before its first token."""
    if first is None or first.prompt_logprobs is None or first.prompt_token_ids is None:
        return _text_logprobs([], 0)
    return _text_logprobs(first.prompt_logprobs, 0, first.prompt_token_ids, first.token_texts, n)


def _end_offset(lp: dict) -> int:
    """Where the text after these logprobs' tokens starts."""
    return lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else 0


def _extend(lp: dict, more: dict) -> None:
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        lp[key].extend(more[key])


def _vllm_prompt_logprobs(first: StreamChunk | None, n: int) -> list | None:
    """vLLM's prompt_logprobs, from the stream's first chunk: null for the first prompt token, then per token
    {id: {"logprob", "rank", "decoded_token"}} for the token itself and the top n (ids as JSON keys are
    strings). The top n's ranks are 1…n; the prompt token's is its rank in the whole vocabulary (the engine
    counts it), or, when it is one of the top n, its place there (as vLLM's dict, whose top n entries come
    last, has it even where the token ties with others). None if the request ended before its first token."""
    if first is None or first.prompt_logprobs is None:
        return None
    out: list[dict | None] = [None]
    assert first.token_texts is not None, "prompt logprobs come with their texts"
    text = first.token_texts.text
    for lp in first.prompt_logprobs[1:]:
        tid = lp.token_id
        top = lp.top[:n]
        rank = lp.rank if lp.rank is not None else next((r for r, (i, _) in enumerate(top, 1) if i == tid), None)
        entry = {str(tid): {"logprob": lp.logprob, "rank": rank, "decoded_token": text(tid)}}
        for r, (i, v) in enumerate(top, 1):
            entry[str(i)] = {"logprob": v, "rank": r, "decoded_token": text(i)}
        out.append(entry)
    return out


def _chat_logprobs(lps: list[Logprob]) -> dict:
    """Chat's logprobs: per token its text, logprob and bytes, and its top alternatives alike."""
    def entry(texts: TokenTexts, token_id: int, logprob: float) -> dict:
        return {"token": texts.text(token_id), "logprob": logprob, "bytes": list(texts.token_bytes(token_id))}

    content = []
    for lp in lps:
        t = lp.token_texts
        assert t is not None, "a chunk's logprobs come with their texts"
        content.append({**entry(t, lp.token_id, lp.logprob), "top_logprobs": [entry(t, i, v) for i, v in lp.top]})
    return {"content": content}
