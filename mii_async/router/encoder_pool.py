"""EncoderPool: the router's prompt encoding (chat templates, tokenization) on threads of its own, where no
prompt can hold back a short one.

Encoding a long prompt takes seconds (~1 s a megabyte of text), and the router's loop must never wait on it,
nor a four-token request behind four long ones. So: `threads` threads (a few; they share the CPU with the
workers), each with its own tokenizer (a fast tokenizer must not be used by two threads at once), and one
queue ordered short-first then by arrival. One thread takes short prompts only, so that however many long
ones are queued or running, a short prompt waits for at most one other short one. Long prompts are taken in
arrival order by the other threads. How long a prompt may be at all is admission's (text/prompts.py's bound,
checked before a job is queued), so a job here is at most what the context can hold.

A job whose request ended while it waited (aborted, its client gone) is skipped when a thread reaches it.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ..text.prompts import PromptEncoder, prompt_chars
from .core import Encode

log = logging.getLogger("mii_async.router")
SHORT_CHARS = 16_384        # a prompt of at most this many characters (~4k tokens, a few ms) is short


def default_threads() -> int:
    """Two on a small machine (one of them for short prompts), up to four on a large one."""
    return min(4, max(2, (os.cpu_count() or 2) // 4))


class EncoderPool:
    def __init__(self, threads: int = 0) -> None:
        self.threads = threads or default_threads()
        self._queue: list[tuple[int, int, Encode, Callable[[], bool], asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._workers: list[threading.Thread] = []

    def start(self, tokenizers: list[Any]) -> None:
        """Starts one thread per tokenizer (`threads` of them, each its own instance)."""
        assert len(tokenizers) == self.threads, "one tokenizer per thread"
        for i, tok in enumerate(tokenizers):
            t = threading.Thread(target=self._run, args=(PromptEncoder(tok), i == 0), name=f"mii_async-encode-{i}",
                                 daemon=True)
            t.start()
            self._workers.append(t)

    def encode(self, job: Encode, wanted: Callable[[], bool]) -> asyncio.Future:
        """A future of `(text, ids)` for `job` (or its exception); `wanted()` false when a thread reaches it
        skips the job, and the future gets None."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        chars = prompt_chars(job.prompt, job.tools)
        lane = 0 if chars is None or chars <= SHORT_CHARS else 1
        with self._cv:
            heapq.heappush(self._queue, (lane, next(self._seq), job, wanted, fut, loop))
            self._cv.notify_all()
        return fut

    def close(self) -> None:
        """Stops the threads once their current job is done; queued jobs are dropped (their requests end with
        the router)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _take(self, short_only: bool) -> tuple | None:
        with self._cv:
            while True:
                if self._closed:
                    return None
                if self._queue and (not short_only or self._queue[0][0] == 0):
                    return heapq.heappop(self._queue)
                self._cv.wait()

    def _run(self, encoder: PromptEncoder, short_only: bool) -> None:
        while (item := self._take(short_only)) is not None:
            _, _, job, wanted, fut, loop = item
            result: Any = None
            error: BaseException | None = None
            if wanted():
                try:
                    result = encoder.encode(job.prompt, job.tools, job.parallel_tool_calls, options=job.options)
                except Exception as exc:  # noqa: BLE001 - a tokenizer error on odd input refuses that request
                    error = exc
            loop.call_soon_threadsafe(_settle, fut, result, error)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
