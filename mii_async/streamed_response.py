"""A Response assembled from one request's StreamChunks as they arrive, and the piece a DeepSpeed-MII
`streaming_fn` receives for each chunk.

What `generate(..., streaming_fn=cb)` and `generate(..., max_length=n)` collect: both read the request as a
stream (the callback sees every piece; the length bound is checked per chunk), and still return the
Response that `generate` returns otherwise.
"""
from __future__ import annotations

import inspect
from contextlib import aclosing, suppress
from typing import Any, AsyncIterator, Callable

from .errors import InvalidParameterError, MIIAsyncError
from .outputs import Logprob, Response, StreamChunk
from .sync_facade import loop_running
from .text.prompts import is_messages, is_token_ids

StreamingFn = Callable[[list[Response]], Any]


class ResponseBuilder:
    """Feeds on a request's chunks in order; `response()` once the last one (with finish_reason) is in."""

    def __init__(self, prompt: Any, return_full_text: bool = False, want_logprobs: bool = False) -> None:
        self.prompt = prompt
        self.return_full_text = return_full_text
        self.want_logprobs = want_logprobs
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[Logprob] = []
        self.prompt_ids: list[int] = []
        self.prompt_logprobs: list[Logprob | None] | None = None
        self.last: StreamChunk | None = None

    def add(self, c: StreamChunk) -> None:
        self.text.append(c.text)
        self.ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs or ())
        if c.prompt_token_ids is not None:
            self.prompt_ids = list(c.prompt_token_ids)
        if c.prompt_logprobs is not None:
            self.prompt_logprobs = c.prompt_logprobs
        self.last = c

    def piece(self, c: StreamChunk) -> Response:
        """What DeepSpeed-MII hands a streaming callback for the chunk `c` (added already): its text and ids,
        finish_reason None until the last piece."""
        return Response(c.text, len(self.prompt_ids), len(c.token_ids), c.finish_reason,   # type: ignore[arg-type]
                        list(c.token_ids), self.prompt_ids, c.logprobs, c.usage, c.error, None)

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None

    def response(self) -> Response:
        last = self.last
        assert last is not None and last.finish_reason is not None, "stream ended without a finish reason"
        out = "".join(self.text)
        if self.return_full_text and isinstance(self.prompt, str):
            out = self.prompt + out
        usage = last.usage
        return Response(out, usage.prompt_tokens if usage else len(self.prompt_ids), len(self.ids),
                        last.finish_reason, self.ids, self.prompt_ids,
                        self.logprobs if self.want_logprobs else None, usage, last.error, self.prompt_logprobs)


async def collect(chunks: AsyncIterator[StreamChunk], prompt: Any, return_full_text: bool = False,
                  want_logprobs: bool = False) -> Response:
    """The Response of one request read as a stream (closed here, whatever happens)."""
    builder = ResponseBuilder(prompt, return_full_text, want_logprobs)
    async with aclosing(chunks) as cs:           # type: ignore[type-var]
        async for c in cs:
            builder.add(c)
    return builder.response()


def generate_streaming(client: Any, prompts: Any, streaming_fn: StreamingFn, options: dict[str, Any]) -> Any:
    """`client.generate(prompts, streaming_fn=cb, **options)`: one prompt's answer streamed, `cb([piece])`
    called for each piece in the caller's thread (from plain code: the call blocks; from a coroutine: the
    returned coroutine calls it on the caller's loop, and awaits it when it returns an awaitable). Returns
    `[Response]` for the whole answer. A callback that raises ends the request (aborted at the router) and
    the error propagates."""
    if not callable(streaming_fn):
        raise InvalidParameterError("streaming_fn", f"must be a function taking a list of Responses, got "
                                    f"{type(streaming_fn).__name__}")
    prompt = _one_prompt(prompts)
    builder = ResponseBuilder(prompt, options.get("return_full_text") is True, options.get("logprobs") is not None)
    stream = client.stream(prompt, **options)
    if loop_running():
        return _streaming(stream, builder, streaming_fn)
    try:
        for c in stream:
            builder.add(c)
            streaming_fn([builder.piece(c)])
    finally:
        if not builder.finished:
            with suppress(MIIAsyncError):        # a closed client has ended its streams already
                stream.close()
    return [builder.response()]


async def _streaming(stream: Any, builder: ResponseBuilder, streaming_fn: StreamingFn) -> list[Response]:
    async with aclosing(stream) as cs:
        async for c in cs:
            builder.add(c)
            result = streaming_fn([builder.piece(c)])
            if inspect.isawaitable(result):
                await result
    return [builder.response()]


def _one_prompt(prompts: Any) -> Any:
    if isinstance(prompts, str) or is_token_ids(prompts) or is_messages(prompts):
        return prompts
    if isinstance(prompts, (list, tuple)) and len(prompts) == 1:
        return prompts[0]
    raise InvalidParameterError("streaming_fn", "streams the answer to one prompt (as DeepSpeed-MII's does): give "
                                "one prompt, or call generate once per prompt")
