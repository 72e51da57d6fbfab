"""AsyncClient: streams tokens from a deployment's router over ZeroMQ.

    client = mii_async.serve()                      # or mii_async.client("tcp://127.0.0.1:5555")
    async for chunk in client.stream("Hello", max_new_tokens=32):
        print(chunk.text, end="")
    responses = await client.generate(["a", "b"], max_new_tokens=8)
    responses = client(["a", "b"], max_new_tokens=8)   # the synchronous facade, for scripts

Concurrency: any number of streams may run at once, from any number of tasks; each event loop that uses the
client gets its own DEALER socket and reader task, so the client may be shared by threads with loops of their
own. The sync facade runs on a private loop thread. Cancellation: leaving an `async for` early, or cancelling
the task that awaits `stream`/`generate`, sends an Abort; the replica frees the request's KV blocks within a
step. Liveness: while requests are outstanding the client pings the router every `ping_s`; a router silent
for `timeout_s` fails them with UnavailableError instead of hanging (and, should it only have stalled, tells it
to abort them). Closing: `close()` ends the open streams with UnavailableError, aborts them at the router and
releases the sockets, the ZeroMQ context and the sync loop at once; later calls raise EngineClosedError. A
request too large for one frame (16 MiB) raises RequestTooLongError before it is sent. `terminate_server()`
stops the deployment.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from typing import Any, AsyncIterator, Coroutine, Sequence, TypeVar

import zmq.asyncio

from . import protocol as P
from .client_connection import Connection, ConnectionConfig, Lost, within
from .errors import (EngineClosedError, InvalidParameterError, RequestTooLongError, UnavailableError,
                     error_from_code)
from .outputs import Logprob, Response, StreamChunk, Usage
from .params import SamplingParams
from .text.chat_tools import check_tools, keep_call_markers
from .text.prompts import check_token_ids, is_messages, is_token_ids
from .transport import DealerSocket
from .text.unicode_text import check_text

T = TypeVar("T")
Prompt = Any   # str | list[int] (token ids) | list[dict] (chat messages)


def _release(ctx: zmq.asyncio.Context, socks: list[DealerSocket]) -> None:
    for sock in socks:
        sock.close()
    ctx.term()


def _close_then_set(conn: Connection, closed: threading.Event) -> None:
    try:
        conn.close()
    finally:
        closed.set()


def _term_after(ctx: zmq.asyncio.Context, closing: list[threading.Event], timeout_s: float = 5.0) -> None:
    for closed in closing:
        closed.wait(timeout_s)
    ctx.term()


async def _stop_when_idle(timeout_s: float = 5.0) -> None:
    """Stops the running loop once its other tasks are done (at most `timeout_s` from now)."""
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    deadline = loop.time() + timeout_s
    while (others := [t for t in asyncio.all_tasks() if t is not me]) and loop.time() < deadline:
        await asyncio.wait(others, timeout=deadline - loop.time())
    await asyncio.sleep(0)            # the finished coroutines' results reach their threads first
    loop.stop()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The sync facade's loop thread: runs until close() stops it, then frees the loop's descriptors."""
    loop.run_forever()
    loop.close()


class AsyncClient:
    def __init__(self, address: str, *, curve_dir: str | None = None, ping_s: float = 2.0,
                 timeout_s: float = 30.0, _process: Any = None, _gateway: Any = None) -> None:
        self.address = address
        self.curve_dir = curve_dir
        self.ping_s, self.timeout_s = ping_s, timeout_s
        self._conn_config = ConnectionConfig(address, curve_dir, ping_s, timeout_s)   # every loop's connection's
        self._process = _process                  # the RouterProcess when serve() started it
        self._gateway = _gateway                  # its GatewayProcess, with serve(enable_http=True)
        self.http_url: str | None = _gateway.url if _gateway is not None else None
        self._ctx = zmq.asyncio.Context()
        # A client dropped without close(): its sockets are closed, then the context, when it is collected.
        # Left to itself, the context's own finalizer waits in term() for sockets still open; and the
        # context's weak set of its sockets may be cleared by then, so the finalizer holds them itself.
        self._socks: list[DealerSocket] = []
        # Not at exit: daemon threads may still poll the sockets then, and pyzmq skips term() at exit anyway.
        self._finalizer = weakref.finalize(self, _release, self._ctx, self._socks)
        self._finalizer.atexit = False
        self._conns: dict[asyncio.AbstractEventLoop, Connection] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._sync_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # -- streaming -----------------------------------------------------------------------------------
    async def stream(self, prompt: Prompt, *, tools: list[dict] | None = None, parallel_tool_calls: bool = True,
                     fit_context: bool = False, **params: Any) -> AsyncIterator[StreamChunk]:
        """Yields a StreamChunk per sampled token as soon as the router has it; the last one carries
        finish_reason and usage. A refused request raises (InvalidParameterError naming the parameter,
        OverloadedError, UnavailableError); a request that fails later ends with finish_reason "error".

        `tools` (a chat only): function tools, OpenAI's shape, that the router renders into the chat's prompt
        (the template's own way, or a system section asking for `<tool_call>` blocks); `parallel_tool_calls`:
        whether that prompt allows several calls per answer. An answer that is not guided keeps the markers
        where the tokenizer holds them as special tokens, unless `skip_special_tokens` is given. `fit_context`:
        max_new_tokens is lowered to the room the prompt leaves in the context and the KV pool."""
        sp = SamplingParams.from_kwargs(**params)   # checked here, naming the parameter; the router checks again
        fields = _generate_fields(params, tools, parallel_tool_calls, fit_context)
        async for d in self._deltas(prompt, sp, fields):
            yield _chunk(d)

    async def generate(self, prompts: Prompt | Sequence[Prompt], *, tools: list[dict] | None = None,
                       parallel_tool_calls: bool = True, fit_context: bool = False,
                       **params: Any) -> list[Response]:
        """One Response per prompt, in order; a single prompt still gives a list. If one prompt is refused,
        the others are aborted and the error is raised. `tools`, `parallel_tool_calls`, `fit_context`: as
        for `stream`, for every prompt."""
        if isinstance(prompts, str) or is_token_ids(prompts) or is_messages(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidParameterError("prompts", "must be a non-empty list of prompts")
        sp = SamplingParams.from_kwargs(**params)   # once for every prompt
        fields = _generate_fields(params, tools, parallel_tool_calls, fit_context)
        tasks = [asyncio.ensure_future(self._collect(p, sp, fields)) for p in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def __call__(self, prompts: Prompt | Sequence[Prompt], **params: Any) -> list[Response]:
        """The synchronous facade: `generate` run on the client's own loop thread; blocks until done."""
        return self.run(self.generate(prompts, **params))

    async def _deltas(self, prompt: Prompt, sp: SamplingParams,
                      fields: dict[str, Any] | None = None) -> AsyncIterator[P.Delta]:
        """`sp`: the caller's parameters, checked; `fields`: the Generate's fields beside the prompt and params
        (_generate_fields, checked)."""
        conn = self._conn()
        req_id = str(next(self._ids))
        msg = P.Generate(req_id=req_id, params=sp.to_wire(), **(fields or {}))
        if msg.tools is not None and not is_messages(prompt):
            raise InvalidParameterError("tools", "tools go with a chat: give the prompt as messages")
        if isinstance(prompt, str):
            check_text("prompt", prompt)                 # msgpack could not carry it
            msg.prompt = prompt
        elif is_token_ids(prompt):
            check_token_ids(prompt)
            msg.prompt_ids = list(prompt)
        elif is_messages(prompt):
            msg.messages = [dict(m) for m in prompt]
            for i, m in enumerate(msg.messages):
                check_text(f"messages[{i}]", m)
                if not all(isinstance(k, str) for k in m):   # msgpack's maps on the wire take string keys
                    raise InvalidParameterError(f"messages[{i}]", "keys must be strings")
        else:
            raise InvalidParameterError("prompt", "must be a string, a list of token ids or a list of chat messages")
        q = conn.open_stream(req_id)
        done = False
        try:
            try:
                await conn.send(msg)
            except P.FrameTooLarge as exc:       # the router's socket would drop this client's connection
                done = True
                raise RequestTooLongError("messages" if msg.messages is not None else "prompt", str(exc)) from None
            conn.sent(req_id)
            while True:
                item = await q.get()
                if isinstance(item, Lost):   # not done: a router that was only stalled must still abort it
                    raise UnavailableError(str(item))
                if isinstance(item, P.ErrorReply):
                    done = True
                    raise error_from_code(item.code, item.message, item.param)
                done = item.finish_reason is not None
                yield item
                if done:
                    return
        finally:
            conn.end_stream(req_id)
            if not done and not self._closed:
                conn.send_later(P.Abort(req_id=req_id))

    async def _collect(self, prompt: Prompt, sp: SamplingParams, fields: dict[str, Any]) -> Response:
        text, ids, lps = [], [], []
        prompt_ids: list[int] = []
        prompt_lps: list[Logprob | None] | None = None
        last: P.Delta | None = None
        async for d in self._deltas(prompt, sp, fields):
            text.append(d.text)
            ids.extend(d.token_ids)
            if d.logprobs:
                lps.extend(map(Logprob.from_wire, d.token_ids, d.logprobs, itertools.repeat(d.token_texts)))
            if d.prompt_ids is not None:
                prompt_ids = d.prompt_ids
            if d.prompt_logprobs is not None:          # decode saw the prompt's ids in the same Delta
                prompt_lps = d.prompt_logprobs.to_logprobs(prompt_ids, d.token_texts)
            last = d
        assert last is not None and last.finish_reason is not None, "stream ended without a finish reason"
        out = "".join(text)
        if sp.return_full_text and isinstance(prompt, str):
            out = prompt + out
        usage = _usage(last.usage)
        return Response(out, usage.prompt_tokens if usage else len(prompt_ids), len(ids), last.finish_reason, ids,
                        prompt_ids, lps if sp.logprobs is not None else None, usage, last.error,
                        prompt_lps)

    # -- the deployment ------------------------------------------------------------------------------
    async def health(self) -> dict:
        """The router's view: state ("ready", "starting", "draining", "unavailable"), replicas, counters."""
        return await self._query("health")

    async def stats(self) -> dict:
        """Fresh engine counters summed over ready replicas (used_blocks, free_blocks, running, waiting, …),
        per replica under "replicas", and under "unanswered" the replicas that did not answer in time (their
        counters are missing from the sums)."""
        return await self._query("stats")

    async def reset_prefix_cache(self) -> dict:
        """Every ready replica forgets the prefixes of the KV blocks no request holds (what a benchmark does
        between runs of the same prompts); requests running meanwhile are not disturbed. Returns the fresh
        counters, with `prefix_blocks_forgotten`. Concurrency and cancellation are those of `stats()`. A
        replica that does not answer makes it an UnavailableError that names it: the others did forget."""
        return await self._query("reset_prefix_cache")

    async def terminate_server(self, drain_s: float = 10.0) -> None:
        """Stops the deployment: live requests get up to `drain_s` to finish, then end with "abort"; every
        router and worker process exits. Returns once the router has exited when this client started it."""
        req_id = f"shutdown-{next(self._ids)}"
        await within(self._ask(req_id, P.Shutdown(drain_s=float(drain_s), req_id=req_id)), self.timeout_s)
        if self._process is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._process.wait, drain_s + 60.0)
            self._process.stop(10.0)
            if self._gateway is not None:                # after the drain: its streams were part of it
                await asyncio.get_running_loop().run_in_executor(None, self._gateway.stop, 10.0)
            self.close()                                # the deployment is gone; a remote one may not be

    def terminate_server_sync(self, drain_s: float = 10.0) -> None:
        """`terminate_server` for synchronous code."""
        self.run(self.terminate_server(drain_s))

    async def _query(self, what: str) -> dict:
        req_id = f"q-{next(self._ids)}"
        return await self._ask(req_id, P.Query(req_id=req_id, what=what))

    async def _ask(self, req_id: str, msg: P.Message) -> dict:
        """Sends `msg` and waits for the QueryReply with `req_id` (UnavailableError if the router is silent)."""
        conn = self._conn()
        fut = conn.open_query(req_id)
        try:
            await conn.send(msg)
            return await fut
        finally:
            conn.end_query(req_id)

    # -- plumbing ------------------------------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs one of this client's coroutines from synchronous code, on the client's private loop thread.
        After close(): EngineClosedError (that loop is stopped; the coroutine would never run)."""
        with self._lock:
            if self._closed:
                coro.close()
                raise EngineClosedError("the client is closed")
            if self._sync_loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=_run_loop, args=(loop,), name="mii_async-client", daemon=True).start()
                self._sync_loop = loop
        fut = asyncio.run_coroutine_threadsafe(coro, self._sync_loop)
        try:
            return fut.result()
        except BaseException:
            # Interrupted (Ctrl-C) or failed: cancel the coroutine, so that its requests are aborted at the
            # router instead of running on to max_new_tokens.
            fut.cancel()
            raise

    def _conn(self) -> Connection:
        if self._closed:
            raise EngineClosedError("the client is closed")
        loop = asyncio.get_running_loop()
        with self._lock:
            conn = self._conns.get(loop)
            if conn is None:
                for old in [lp for lp in self._conns if lp.is_closed()]:   # e.g. one asyncio.run() per call
                    sock = self._conns.pop(old).sock
                    sock.close()
                    self._socks.remove(sock)
                conn = self._conns[loop] = Connection(self._conn_config, self._ctx, loop)
                self._socks.append(conn.sock)
        return conn

    def close(self) -> None:
        """Closes every socket of this client (idempotent): its open streams end with UnavailableError and are
        aborted at the router; later calls raise EngineClosedError. The sockets, the ZeroMQ context and the sync
        facade's loop are released now, not when the client is collected. A deployment it started keeps running
        until `terminate_server()`, or until this process exits."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = list(self._conns.values()), {}
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        closing: list[threading.Event] = []          # set once a socket on another loop is closed there
        for conn in conns:
            if conn.loop is running or not conn.loop.is_running():
                conn.close()
                continue
            closed = threading.Event()
            closing.append(closed)
            try:
                conn.loop.call_soon_threadsafe(_close_then_set, conn, closed)
            except RuntimeError:                     # that loop closed meanwhile
                _close_then_set(conn, closed)
        # Not here: term() waits for the last Aborts to leave (ABORT_LINGER_S), and only after the sockets on
        # other loops are closed (before, their Aborts would fail with ContextTerminated).
        self._finalizer.detach()
        threading.Thread(target=_term_after, args=(self._ctx, closing), name="mii_async-client-close",
                         daemon=True).start()
        if self._sync_loop is not None:
            # Not at once: close() may be running on that loop, inside a coroutine whose result is still to
            # be handed to the waiting thread, and other threads' coroutines end (their streams failed) first.
            asyncio.run_coroutine_threadsafe(_stop_when_idle(), self._sync_loop)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._process is not None:
            await self.terminate_server()
        self.close()

    def __enter__(self) -> AsyncClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._process is not None:
            self.terminate_server_sync()
        self.close()


def _generate_fields(params: dict[str, Any], tools: Any, parallel_tool_calls: Any,
                     fit_context: Any) -> dict[str, Any]:
    """A Generate's fields beside the prompt and `params` (the sampling keywords as given), checked here, where
    the caller can be named: msgpack could not carry a malformed tool."""
    if tools is not None:
        check_tools(tools)
    for name, v in (("parallel_tool_calls", parallel_tool_calls), ("fit_context", fit_context)):
        if not isinstance(v, bool):
            raise InvalidParameterError(name, "must be true or false")
    return {"tools": None if tools is None else list(tools), "parallel_tool_calls": parallel_tool_calls,
            "keep_tool_markers": keep_call_markers(tools, params), "fit_context": fit_context}


def _usage(u: dict | None) -> Usage | None:
    if u is None:
        return None
    return Usage(u["prompt_tokens"], u["completion_tokens"], u.get("cached_tokens", 0))


def _chunk(d: P.Delta) -> StreamChunk:
    texts = d.token_texts
    lps = list(map(Logprob.from_wire, d.token_ids, d.logprobs, itertools.repeat(texts))) if d.logprobs else None
    plps = d.prompt_logprobs.to_logprobs(d.prompt_ids, texts) if d.prompt_logprobs is not None else None
    return StreamChunk(d.text, list(d.token_ids), lps, d.finish_reason, _usage(d.usage), d.error, plps,
                       d.prompt_ids, texts)
