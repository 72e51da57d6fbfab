"""Streams of several choices at once: open them all (so that a refused request is an HTTP error, not a
broken stream), then merge their chunks as they come.

Cancellation: closing a merged iterator (the client went away) cancels every stream in it, which aborts each
request at the router; their KV blocks are freed within a step.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncIterator, NamedTuple

from ..outputs import StreamChunk
from .state import GatewayState

_END = object()


class Job(NamedTuple):
    index: int                 # the choice's index in the answer
    prompt_index: int          # which of the request's prompts (n choices share one)
    prompt: Any                # str | list[int] | chat messages
    params: dict[str, Any]     # client.stream's keywords: sampling parameters by mii_async's names, and a chat's
                               # tools, parallel_tool_calls and fit_context


class Opened(NamedTuple):
    job: Job
    first: StreamChunk         # already received
    rest: AsyncIterator[StreamChunk]


async def open_streams(state: GatewayState, api: str, jobs: list[Job]) -> list[Opened]:
    """Starts every job and waits for its first chunk; if one is refused, closes the others and raises (the
    error's `job` attribute: the refused job, so that a route can name its prompt)."""
    gens = [state.metrics.track(api, state.client.stream(j.prompt, **j.params)) for j in jobs]
    firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
    k = next((k for k, f in enumerate(firsts) if isinstance(f, BaseException)), None)
    if k is not None:
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
        bad = firsts[k]
        if isinstance(bad, StopAsyncIteration):
            raise RuntimeError("a stream ended before its first chunk")
        bad.job = jobs[k]
        raise bad
    return [Opened(j, f, g) for j, f, g in zip(jobs, firsts, gens)]


async def _chunks(o: Opened) -> AsyncIterator[StreamChunk]:
    yield o.first
    if o.first.finish_reason is None:
        async for c in o.rest:
            yield c


async def merge(opened: list[Opened]) -> AsyncIterator[tuple[Job, StreamChunk | Exception]]:
    """(job, chunk) in arrival order over all streams; an exception ends its own stream only."""
    q: asyncio.Queue = asyncio.Queue()

    async def feed(o: Opened) -> None:
        try:
            async for c in _chunks(o):
                q.put_nowait((o.job, c))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
            q.put_nowait((o.job, exc))
            return
        finally:
            await o.rest.aclose()
        q.put_nowait((o.job, _END))

    tasks = [asyncio.ensure_future(feed(o)) for o in opened]
    try:
        left = len(tasks)
        while left:
            job, item = await q.get()
            if item is _END:
                left -= 1
                continue
            yield job, item
            if isinstance(item, Exception):
                left -= 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(opened: list[Opened]) -> dict[int, list[StreamChunk]]:
    """Every chunk of every stream, by choice index; the first exception is raised (the others cancelled)."""
    out: dict[int, list[StreamChunk]] = {o.job.index: [] for o in opened}
    async with aclosing(merge(opened)) as items:
        async for job, item in items:
            if isinstance(item, Exception):
                raise item
            out[job.index].append(item)
    return out
