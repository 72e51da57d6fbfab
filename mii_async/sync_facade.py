"""One name for both worlds: a client method that runs to completion when called from plain code, and is
awaitable when called from a coroutine.

    client.generate(["Hi"])                    # plain code: blocks, returns the Responses
    await client.generate(["Hi"])              # a coroutine: the same call, awaited
    for piece in client.stream("Hi"): …        # plain code: a blocking iterator
    async for piece in client.stream("Hi"): …  # a coroutine: the async iterator

Which world a call is in is decided by whether an event loop runs in the calling thread. Without one, the
coroutine runs on the owner's private loop thread (`owner.run`), so nothing is handed back un-awaited; with
one, the coroutine is returned for the caller to await (blocking there would stall the caller's own loop).
"""
from __future__ import annotations

import asyncio
import functools
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, Protocol, TypeVar

T = TypeVar("T")


class Runner(Protocol):
    def run(self, coro: Coroutine[Any, Any, T]) -> T: ...


def loop_running() -> bool:
    """Whether an event loop runs in this thread (a call from a coroutine, or from a callback of that loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def dual(method: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., Any]:
    """Wraps an `async def` method of a Runner: from plain code the call returns the result (run on the
    owner's loop thread), from a coroutine it returns the coroutine to await."""
    @functools.wraps(method)
    def call(self: Runner, *args: Any, **kwargs: Any) -> Any:
        coro = method(self, *args, **kwargs)
        return coro if loop_running() else self.run(coro)

    call.__doc__ = (method.__doc__ or "").rstrip() + "\n\n        From plain code the call blocks and returns " \
        "the result; from a coroutine, await it."
    return call


async def _next(it: AsyncIterator[T]) -> T:
    return await it.__anext__()


async def _aclose(it: AsyncIterator[Any]) -> None:
    await it.aclose()                     # type: ignore[attr-defined]


class DualStream:
    """An async iterator (`async for`, `__anext__`, `aclose`) that plain code may also iterate with `for`:
    each step then runs on the owner's loop thread. Leaving a `for` early, or dropping the iterator, closes
    the stream (for a request: aborts it at the router)."""

    def __init__(self, agen: AsyncIterator[Any], owner: Runner) -> None:
        self._agen = agen
        self._owner = owner

    # -- from a coroutine ---------------------------------------------------------------------------
    def __aiter__(self) -> DualStream:
        return self

    def __anext__(self) -> Awaitable[Any]:
        return self._agen.__anext__()

    async def aclose(self) -> None:
        await self._agen.aclose()         # type: ignore[attr-defined]

    # -- from plain code ----------------------------------------------------------------------------
    def __iter__(self) -> DualStream:
        return self

    def __next__(self) -> Any:
        try:
            return self._owner.run(_next(self._agen))
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """Ends the stream from plain code now. Dropping it does the same soon after: its loop finalizes an
        unfinished async generator (asyncio's asyncgen hooks), which aborts the request."""
        self._owner.run(_aclose(self._agen))
