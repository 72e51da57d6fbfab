"""Pipeline: the engine in this process, behind a sync call, an async generate and a token stream.

Concurrency: every method may be called from any thread, and the async ones from any event loop, all sharing
one engine thread that batches whatever is live. Cancellation: cancelling `agenerate`/`stream` (or leaving the
`async for` early) aborts the request; its KV blocks are freed within a step. Closing: `close()` ends live
requests with finish_reason "abort"; later calls raise EngineClosedError.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
from typing import Any, AsyncIterator, Sequence

from .config import EngineConfig
from .engine_thread import EngineThread
from .errors import InvalidParameterError
from .outputs import Response, StreamChunk
from .params import SamplingParams
from .text.chat_tools import keep_call_markers, keeping_markers
from .text.prompts import PromptEncoder, check_prompt_size, is_messages, is_token_ids
from .text.render_options import RenderOptions
from .text.request_state import RequestState

Prompt = Any   # str | list[int] (token ids) | list[dict] (chat messages)


class Pipeline:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self._engine = EngineThread(config)
        self.model_path = self._engine.engine.model_path
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        except BaseException:
            self._engine.close()
            raise
        self._encoder = PromptEncoder(self.tokenizer)
        self._ids = itertools.count()

    # -- public API ----------------------------------------------------------------------------------
    def __call__(self, prompts: Prompt | Sequence[Prompt], *, tools: list[dict] | None = None,
                 parallel_tool_calls: bool = True, render: RenderOptions | dict | None = None,
                 **params: Any) -> list[Response]:
        """Generates for each prompt; blocks until all finish. A single prompt still gives a list. `tools`
        (chats only) and `parallel_tool_calls`: as AsyncClient.stream's, for every prompt; `render`: how each
        prompt is rendered and tokenized (RenderOptions or a dict of its fields: template variables,
        add_generation_prompt, continue_final_message, add_special_tokens, truncate_prompt_tokens)."""
        batch = self._prepare_batch(prompts, params, tools, parallel_tool_calls, render)
        done: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        states: dict[int, RequestState] = {}
        try:
            for state in batch:
                req_id = next(self._ids)
                states[req_id] = state
                self._engine.submit(req_id, state.prompt_ids, state.params,
                                    lambda ev, r=req_id: done.put((r, ev)))
            while not all(s.finished for s in states.values()):
                req_id, ev = done.get()
                self._feed(req_id, states[req_id], ev)
        finally:
            for req_id, s in states.items():
                if not s.finished:
                    self._engine.abort(req_id)
        return [s.response() for s in states.values()]

    async def agenerate(self, prompts: Prompt | Sequence[Prompt], *, tools: list[dict] | None = None,
                        parallel_tool_calls: bool = True, render: RenderOptions | dict | None = None,
                        **params: Any) -> list[Response]:
        """Async `__call__`: one Response per prompt, in order."""
        batch = self._prepare_batch(prompts, params, tools, parallel_tool_calls, render)
        return list(await asyncio.gather(*(self._run(state) for state in batch)))

    async def stream(self, prompt: Prompt, *, tools: list[dict] | None = None, parallel_tool_calls: bool = True,
                     render: RenderOptions | dict | None = None, **params: Any) -> AsyncIterator[StreamChunk]:
        """Yields a StreamChunk per sampled token, as soon as it is sampled; the last one carries
        finish_reason and usage. Leaving the loop early or cancelling aborts the request. `tools`,
        `parallel_tool_calls` and `render`: as `__call__`'s."""
        state = self._prepare(prompt, self._params(params, tools), tools=tools, parallel_tool_calls=parallel_tool_calls,
                              render=RenderOptions.coerce(render))
        req_id = next(self._ids)
        q = self._async_sink(req_id, state)
        try:
            while True:
                chunk = await q.get()
                if state.refusal is not None:
                    raise state.refusal
                if chunk is None:
                    continue
                yield chunk
                # the chunk's own finish_reason, not the state's: events fed while the consumer was away have
                # finished the state already, and their chunks still wait in the queue
                if chunk.finish_reason is not None:
                    return
        finally:
            if not state.finished:
                self._engine.abort(req_id)

    def chat(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
             parallel_tool_calls: bool = True, render: RenderOptions | dict | None = None, **params: Any) -> Response:
        """One chat turn through the tokenizer's chat template (with the tools it shows; `render`: as
        `__call__`'s)."""
        return self([messages], tools=tools, parallel_tool_calls=parallel_tool_calls, render=render, **params)[0]

    def stats(self) -> dict[str, int]:
        """KV pool and scheduler counters (blocks used/free, prefix hits, preemptions, …)."""
        return self._engine.stats()

    def reset_prefix_cache(self) -> int:
        """Forgets the prefixes of the KV blocks no request holds (a benchmark's rerun of the same prompts
        then computes them again); returns how many blocks were forgotten."""
        return self._engine.reset_prefix_cache()

    def close(self) -> None:
        self._engine.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------------
    async def _run(self, state: RequestState) -> Response:
        req_id = next(self._ids)
        q = self._async_sink(req_id, state)
        try:
            while not state.finished:
                await q.get()
        finally:
            if not state.finished:
                self._engine.abort(req_id)
        return state.response()

    def _async_sink(self, req_id: int, state: RequestState) -> asyncio.Queue[StreamChunk | None]:
        """Submits the request; engine events are processed on the caller's loop, in order."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StreamChunk | None] = asyncio.Queue()

        def on_loop(ev: Any) -> None:
            q.put_nowait(self._feed(req_id, state, ev))

        self._engine.submit(req_id, state.prompt_ids, state.params,
                            lambda ev: loop.call_soon_threadsafe(on_loop, ev))
        return q

    def _feed(self, req_id: int, state: RequestState, ev: Any) -> StreamChunk | None:
        chunk = state.on_event(ev)
        if state.needs_abort:
            state.needs_abort = False
            self._engine.abort(req_id)    # a stop string ended it before the engine knew
        return chunk

    def _prepare_batch(self, prompts: Prompt | Sequence[Prompt], params: dict[str, Any],
                       tools: list[dict] | None = None, parallel_tool_calls: bool = True,
                       render: RenderOptions | dict | None = None) -> list[RequestState]:
        sp = self._params(params, tools)
        options = RenderOptions.coerce(render)
        if isinstance(prompts, str) or is_token_ids(prompts) or is_messages(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidParameterError("prompts", "must be a non-empty list of prompts")
        return [self._prepare(p, sp, keep_logprobs=True, tools=tools, parallel_tool_calls=parallel_tool_calls,
                              render=options) for p in prompts]     # keep_logprobs: for their Responses

    def _params(self, params: dict[str, Any], tools: list[dict] | None) -> SamplingParams:
        """The caller's sampling keywords, checked; an answer read for tool calls keeps the call markers."""
        sp = SamplingParams.from_kwargs(**params)
        return keeping_markers(sp, self.tokenizer) if keep_call_markers(tools, params) else sp

    def _prepare(self, prompt: Prompt, params: SamplingParams, keep_logprobs: bool = False,
                 tools: list[dict] | None = None, parallel_tool_calls: bool = True,
                 render: RenderOptions | None = None) -> RequestState:
        """Tokenizes a text, a list of token ids or chat messages (with their tools); validation errors name
        `prompt`. `keep_logprobs`: the state gathers the logprobs for response() (a stream's chunks carry them
        alone). A text or chat too long for any tokenizer to fit the context is refused before it is tokenized."""
        limits = self._engine.engine.limits
        check_prompt_size(prompt, tools, min(limits.max_model_len, limits.max_request_tokens))
        text, ids = self._encoder.encode(prompt, tools, parallel_tool_calls, render)
        self._engine.engine.check_request(ids, params)
        # return_full_text prepends a text prompt only (as truncate_prompt_tokens left it), as the mesh client
        # does (not a chat's rendered template)
        text = text if isinstance(prompt, str) else None
        return RequestState(self.tokenizer, text, ids, params, keep_logprobs=keep_logprobs,
                            decode_prompt_logprobs=True)        # the chunks carry Logprob objects

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return self._encoder.apply_chat_template(messages)
