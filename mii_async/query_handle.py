"""QueryHandle: `mii_query_handle(model, tensor_parallel=T)`, the seed document's way to ask a model.

    handle = mii_async.mii_query_handle(model, tensor_parallel=1)
    responses = handle.query(prompts=["DeepSpeed is", "Seattle is"], max_new_tokens=128)
    handle.close()

T = 1 runs the model in this process (a Pipeline); T > 1 starts a local deployment of T worker processes
(`serve(model, tensor_parallel=T)`), which `close()` stops, as does this process's exit. `query` takes the
prompts as `prompts=`, positionally, or as DeepSpeed-MII's legacy request dict `{"query": [...]}`, and the
sampling keywords of `generate` (DeepSpeed-MII's `max_length` among them). From plain code it blocks and
returns the Responses; from a coroutine, await it. Concurrency: queries may run at once from any threads and
loops. `close()` blocks until the model is released (a deployment drains for up to 10 s); `aclose()` awaits it.
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from .errors import InvalidParameterError, RequestTooLongError
from .mii_params import cap_length, check_max_length, check_names, length_request
from .outputs import Response
from .streamed_response import collect
from .sync_facade import loop_running
from .text.prompts import is_messages, is_token_ids


class QueryHandle:
    def __init__(self, model: str | None, tensor_parallel: Any, options: dict[str, Any]) -> None:
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise InvalidParameterError("tensor_parallel", f"must be a positive integer (1: in this process), got "
                                        f"{tensor_parallel!r}")
        self.tensor_parallel = tensor_parallel
        self._pipe: Any = None
        self._client: Any = None
        if tensor_parallel == 1:
            from .api import pipeline

            self._pipe = pipeline(model, **options)
        else:
            from .api import serve

            self._client = serve(model, tensor_parallel=tensor_parallel, **options)

    def query(self, request: Any = None, *, prompts: Any = None, **params: Any) -> Any:
        """One Response per prompt, in order (a single prompt still gives a list)."""
        prompts = _prompts(request, prompts)
        check_names(params)
        max_length = params.pop("max_length", None)
        if max_length is not None:
            check_max_length(max_length)
        if self._client is not None:
            return self._client.generate(prompts, max_length=max_length, **params)   # itself sync or awaitable
        if loop_running():
            return self._agenerate(prompts, max_length, params)
        if max_length is None:
            return self._pipe(prompts, **params)
        return asyncio.run(self._agenerate(prompts, max_length, params))

    async def _agenerate(self, prompts: Sequence[Any], max_length: int | None, params: dict[str, Any]
                         ) -> list[Response]:
        if max_length is None:
            return await self._pipe.agenerate(prompts, **params)
        return list(await asyncio.gather(*(self._capped(p, max_length, params) for p in prompts)))

    async def _capped(self, prompt: Any, max_length: int, params: dict[str, Any]) -> Response:
        """One prompt under DeepSpeed-MII's max_length (prompt + output tokens), read as a stream."""
        chunks = cap_length(self._pipe.stream(prompt, **length_request(params, max_length)), max_length)
        try:
            return await collect(chunks, prompt, params.get("return_full_text") is True,
                                 params.get("logprobs") is not None)
        except RequestTooLongError as exc:
            raise InvalidParameterError("max_length", f"{max_length} does not fit this model: {exc}") from None

    def close(self) -> None:
        """Releases the model: the pipeline's engine, or the deployment's processes. Idempotent."""
        if self._pipe is not None:
            self._pipe.close()
        elif self._client is not None and not self._client.closed:
            self._client.terminate_server_sync()

    async def aclose(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
        elif self._client is not None and not self._client.closed:
            await self._client.terminate_server()

    def __enter__(self) -> QueryHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> QueryHandle:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def _prompts(request: Any, prompts: Any) -> list[Any]:
    """`query(prompts=…)`, `query([...])`, `query("text")` or DeepSpeed-MII's legacy `query({"query": [...]})`."""
    if request is not None and prompts is not None:
        raise InvalidParameterError("prompts", "given twice: positionally and as prompts=")
    if isinstance(request, dict):
        if set(request) != {"query"}:
            raise InvalidParameterError("request", "a dict request is DeepSpeed-MII's {'query': [prompts]}; got keys "
                                        f"{sorted(map(str, request))}")
        request = request["query"]
    got = prompts if prompts is not None else request
    if got is None:
        raise InvalidParameterError("prompts", "is required: a string or a list of prompts")
    if isinstance(got, str) or is_token_ids(got) or is_messages(got):
        return [got]
    if not isinstance(got, (list, tuple)) or not got:
        raise InvalidParameterError("prompts", "must be a prompt or a non-empty list of prompts")
    return list(got)
