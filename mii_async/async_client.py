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
step. Liveness: a router that exits is known at once (its connection closes): open streams and queries fail
with UnavailableError ("the router at ADDR is not answering"), and so does every new request, at once, until a
router answers on the address again, which the client finds by itself. While requests are outstanding the
client also pings the router every `ping_s`; a router silent for `liveness_timeout_s` (capped by `timeout_s`)
fails them with UnavailableError instead of hanging (and, should it only have stalled, tells it to abort
them). Closing: `close()` ends the open streams with UnavailableError, aborts them at the router and
releases the sockets, the ZeroMQ context and the sync loop at once; later calls raise EngineClosedError. A
request too large for one frame (16 MiB) raises RequestTooLongError before it is sent. `terminate_server()`
stops the deployment.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import weakref
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Coroutine, Sequence, TypeVar

import zmq.asyncio

from . import protocol as P
from .client_connection import Connection, ConnectionConfig, Lost, within
from .client_loops import close_then_set, on_loop, release, run_loop, stop_when_idle, term_after
from .client_requests import checked_request, chunk_of, put_prompt
from .errors import (EngineClosedError, InvalidParameterError, RequestTooLongError, UnavailableError,
                     error_from_code)
from .mii_params import cap_length
from .outputs import Response, StreamChunk
from .params import SamplingParams
from .streamed_response import collect, generate_streaming
from .sync_facade import DualStream, dual, loop_running
from .text.prompts import is_messages, is_token_ids
from .text.render_options import RenderOptions
from .transport import DealerSocket

if TYPE_CHECKING:
    from .jobs.job_client import JobClient

T = TypeVar("T")
Prompt = Any   # str | list[int] (token ids) | list[dict] (chat messages)
_GENERATE_OPTIONS = ("max_length", "tools", "parallel_tool_calls", "fit_context",   # generate's, not
                     "render")                                                       # sampling's


class AsyncClient:
    def __init__(self, address: str, *, curve_dir: str | None = None, ping_s: float = 2.0,
                 timeout_s: float = 30.0, liveness_timeout_s: float = 10.0, _process: Any = None,
                 _gateway: Any = None) -> None:
        self.address = address
        self.curve_dir = curve_dir
        self.ping_s, self.timeout_s = ping_s, timeout_s
        self._conn_config = ConnectionConfig(address, curve_dir, ping_s, timeout_s,   # every loop's connection's
                                             liveness_timeout_s=liveness_timeout_s)
        self._process = _process                  # the RouterProcess when serve() started it
        self._gateway = _gateway                  # its GatewayProcess, with serve(enable_http=True)
        self.http_url: str | None = _gateway.url if _gateway is not None else None
        self._ctx = zmq.asyncio.Context()
        # A client dropped without close(): its sockets are closed, then the context, when it is collected.
        # Left to itself, the context's own finalizer waits in term() for sockets still open; and the
        # context's weak set of its sockets may be cleared by then, so the finalizer holds them itself.
        self._socks: list[DealerSocket] = []
        # Not at exit: daemon threads may still poll the sockets then, and pyzmq skips term() at exit anyway.
        self._finalizer = weakref.finalize(self, release, self._ctx, self._socks)
        self._finalizer.atexit = False
        self._conns: dict[asyncio.AbstractEventLoop, Connection] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._sync_loop: asyncio.AbstractEventLoop | None = None
        self._jobs: dict[str, JobClient] = {}     # jobs_dir → its JobClient (jobs/job_client.py)
        self._closed = False

    # -- streaming -----------------------------------------------------------------------------------
    def stream(self, prompt: Prompt, *, max_length: int | None = None, tools: list[dict] | None = None,
               parallel_tool_calls: bool = True, fit_context: bool = False,
               render: RenderOptions | dict | None = None, **params: Any) -> DualStream:
        """Yields a StreamChunk per sampled token as soon as the router has it; the last one carries
        finish_reason and usage. A refused request raises (InvalidParameterError naming the parameter,
        OverloadedError, UnavailableError); a request that fails later ends with finish_reason "error".
        A coroutine iterates it with `async for`; plain code with `for` (each step runs on the client's loop
        thread).

        `tools` (a chat only): function tools, OpenAI's shape, that the router renders into the chat's prompt
        (the template's own way, or a system section asking for `<tool_call>` blocks); `parallel_tool_calls`:
        whether that prompt allows several calls per answer. An answer that is not guided keeps the markers
        where the tokenizer holds them as special tokens, unless `skip_special_tokens` is given. `fit_context`:
        max_new_tokens is lowered to the room the prompt leaves in the context and the KV pool. `max_length`
        (DeepSpeed-MII's): at most this many prompt and output tokens in all (mii_params.py). `render`: how the
        router renders and tokenizes the prompt (text/render_options.py RenderOptions, or a dict of its fields)."""
        return DualStream(self._stream(prompt, max_length, tools, parallel_tool_calls, fit_context, params,
                                       render), self)

    async def _stream(self, prompt: Prompt, max_length: int | None, tools: list[dict] | None,
                      parallel_tool_calls: bool, fit_context: bool, params: dict[str, Any],
                      render: Any = None) -> AsyncIterator[StreamChunk]:
        sp, fields = checked_request(params, max_length, tools, parallel_tool_calls, fit_context, render)
        async with aclosing(self._chunks(prompt, sp, fields, max_length)) as chunks:
            async for c in chunks:
                yield c

    def _chunks(self, prompt: Prompt, sp: SamplingParams, fields: dict[str, Any],
                max_length: int | None) -> AsyncIterator[StreamChunk]:
        chunks = (chunk_of(d) async for d in self._deltas(prompt, sp, fields))
        return chunks if max_length is None else cap_length(chunks, max_length)

    def generate(self, prompts: Prompt | Sequence[Prompt], *,
                 streaming_fn: Callable[[list[Response]], Any] | None = None, max_length: int | None = None,
                 tools: list[dict] | None = None, parallel_tool_calls: bool = True, fit_context: bool = False,
                 render: RenderOptions | dict | None = None, **params: Any) -> Any:
        """One Response per prompt, in order; a single prompt still gives a list. If one prompt is refused,
        the others are aborted and the error is raised. `max_length`, `tools`, `parallel_tool_calls`,
        `fit_context`: as for `stream`, for every prompt. `streaming_fn` (DeepSpeed-MII's): one prompt's answer
        is streamed, and the function called with `[Response]` for each piece (streamed_response.py).
        From plain code the call blocks and returns the Responses; from a coroutine, await it."""
        options = dict(max_length=max_length, tools=tools, parallel_tool_calls=parallel_tool_calls,
                       fit_context=fit_context, render=render, **params)
        if streaming_fn is not None:
            return generate_streaming(self, prompts, streaming_fn, options)
        coro = self._generate(prompts, options)
        return coro if loop_running() else self.run(coro)

    async def _generate(self, prompts: Prompt | Sequence[Prompt], options: dict[str, Any]) -> list[Response]:
        if isinstance(prompts, str) or is_token_ids(prompts) or is_messages(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidParameterError("prompts", "must be a non-empty list of prompts")
        params = {k: v for k, v in options.items() if k not in _GENERATE_OPTIONS}
        max_length = options["max_length"]
        sp, fields = checked_request(params, max_length, options["tools"], options["parallel_tool_calls"],
                              options["fit_context"], options["render"])  # once for every prompt
        coros = [collect(self._chunks(p, sp, fields, max_length), p, sp.return_full_text, sp.logprobs is not None)
                 for p in prompts]
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def __call__(self, prompts: Prompt | Sequence[Prompt], **params: Any) -> Any:
        """`generate`: from plain code it blocks (on the client's own loop thread) and returns the Responses;
        from a coroutine, await it."""
        return self.generate(prompts, **params)

    async def _deltas(self, prompt: Prompt, sp: SamplingParams,
                      fields: dict[str, Any] | None = None) -> AsyncIterator[P.Delta]:
        """`sp`: the caller's parameters, checked; `fields`: the Generate's fields beside the prompt and params
        (client_requests.py, checked)."""
        conn = self._conn()
        req_id = str(next(self._ids))
        msg = P.Generate(req_id=req_id, params=sp.to_wire(), **(fields or {}))
        put_prompt(msg, prompt)
        conn.check_up()                  # a router known to be gone: refused here, with no Abort to send later
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

    # -- the deployment ------------------------------------------------------------------------------
    @dual
    async def health(self) -> dict:
        """The router's view: state ("ready", "starting", "draining", "unavailable"), replicas, counters."""
        return await self._query("health")

    @dual
    async def stats(self) -> dict:
        """Fresh engine counters summed over ready replicas (used_blocks, free_blocks, running, waiting, …),
        per replica under "replicas", and under "unanswered" the replicas that did not answer in time (their
        counters are missing from the sums)."""
        return await self._query("stats")

    @dual
    async def reset_prefix_cache(self) -> dict:
        """Every ready replica forgets the prefixes of the KV blocks no request holds (what a benchmark does
        between runs of the same prompts); requests running meanwhile are not disturbed. Returns the fresh
        counters, with `prefix_blocks_forgotten`. Concurrency and cancellation are those of `stats()`. A
        replica that does not answer makes it an UnavailableError that names it: the others did forget."""
        return await self._query("reset_prefix_cache")

    @dual
    async def terminate_server(self, drain_s: float = 10.0) -> None:
        """Stops the deployment: live requests get up to `drain_s` to finish, then end with "abort"; every
        router and worker process exits. Returns once the router has exited when this client started it."""
        req_id = f"shutdown-{next(self._ids)}"
        for jobs in list(self._jobs.values()):      # batch lines it runs stay pending, not answered by the drain
            jobs.close()
        await within(self._ask(req_id, P.Shutdown(drain_s=float(drain_s), req_id=req_id)), self.timeout_s)
        if self._process is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._process.wait, drain_s + 60.0)
            self._process.stop(10.0)
            if self._gateway is not None:                # after the drain: its streams were part of it
                await asyncio.get_running_loop().run_in_executor(None, self._gateway.stop, 10.0)
            self.close()                                # the deployment is gone; a remote one may not be

    def terminate_server_sync(self, drain_s: float = 10.0) -> None:
        """`terminate_server` that blocks, from plain code or (stalling its loop) from a coroutine."""
        self.run(self.terminate_server(drain_s))

    @dual
    async def wait_terminated(self, timeout_s: float | None = None) -> bool:
        """Waits until the deployment that serve() started for this client has stopped, whoever stopped it
        (this client, another that found it by name, the gateway's GET /terminate); True if it has, False
        after `timeout_s` (None: no limit). Cancelling the wait leaves the deployment as it is."""
        if self._process is None:
            raise InvalidParameterError("client", "only the client that serve() returned knows the deployment's "
                                        "processes; another client can ask health()")
        return await asyncio.get_running_loop().run_in_executor(None, self._process.wait, timeout_s)

    @property
    def jobs(self) -> JobClient:
        """The Batch API's store from Python without HTTP: submit, get, list, cancel, results, progress
        (jobs/job_client.py, docs/jobs.md), in the jobs_dir of the gateway that serve(enable_http=True) started
        with this client, else in HttpConfig's default. `job_client(jobs_dir)` for another directory."""
        return self.job_client()

    def job_client(self, jobs_dir: str | None = None) -> JobClient:
        """The JobClient on `jobs_dir` (None: as `jobs` says), made at the first call; closed with this client.
        On the directory of the gateway this client's serve() started, it keeps that gateway's job limits, model
        name and leniency (its HttpConfig); elsewhere HttpConfig's defaults."""
        from .jobs.job_client import JobClient, served_jobs_dir

        path, served = served_jobs_dir(self._gateway.http if self._gateway is not None else None, jobs_dir)
        with self._lock:
            if self._closed:
                raise EngineClosedError("the client is closed")
            if path not in self._jobs or self._jobs[path].closed:
                self._jobs[path] = JobClient(self, path, http=served)
            return self._jobs[path]

    @property
    def closed(self) -> bool:
        """Whether close() (or terminate_server()) has run: later calls raise EngineClosedError."""
        return self._closed

    async def _query(self, what: str) -> dict:
        req_id = f"q-{next(self._ids)}"
        return await self._ask(req_id, P.Query(req_id=req_id, what=what))

    async def _ask(self, req_id: str, msg: P.Message) -> dict:
        """Sends `msg` and waits for the QueryReply with `req_id` (UnavailableError if the router is silent or
        gone)."""
        conn = self._conn()
        conn.check_up()
        fut = conn.open_query(req_id)
        try:
            await conn.send(msg)
            return await fut
        finally:
            conn.end_query(req_id)

    # -- plumbing ------------------------------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T] | T) -> T:
        """Runs one of this client's coroutines from synchronous code, on the client's private loop thread.
        After close(): EngineClosedError (that loop is stopped; the coroutine would never run). A value that
        is not a coroutine is handed back: a method called from plain code has run already, so that
        `client.run(client.health())` means what it says either way."""
        if not asyncio.iscoroutine(coro):
            return coro
        with self._lock:
            if self._closed:
                coro.close()
                raise EngineClosedError("the client is closed")
            if self._sync_loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=run_loop, args=(loop,), name="mii_async-client", daemon=True).start()
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

    def mark_unavailable(self, reason: str) -> None:
        """Tells this client that its router is gone, for a caller that knows it before the socket does (a
        gateway whose parent, which runs the router, exited): open streams and queries fail with
        UnavailableError(`reason`) now, later requests at once, until a router's connection completes its
        handshake again. Any thread: each connection is failed on its own loop (now, if that is this one)."""
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            with contextlib.suppress(RuntimeError):           # that loop closed: nothing of it left to fail
                if conn.loop.is_running() and not on_loop(conn.loop):
                    conn.loop.call_soon_threadsafe(conn.mark_down, reason)
                else:
                    conn.mark_down(reason)

    def close(self) -> None:
        """Closes every socket of this client (idempotent): its open streams end with UnavailableError and are
        aborted at the router; later calls raise EngineClosedError. The sockets, the ZeroMQ context and the sync
        facade's loop are released now, not when the client is collected. A deployment it started keeps running
        until `terminate_server()`, or until this process exits."""
        for jobs in list(self._jobs.values()):      # first: its lines in flight are aborted, not failed
            jobs.close()
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
                conn.loop.call_soon_threadsafe(close_then_set, conn, closed)
            except RuntimeError:                     # that loop closed meanwhile
                close_then_set(conn, closed)
        # Not here: term() waits for the last Aborts to leave (ABORT_LINGER_S), and only after the sockets on
        # other loops are closed (before, their Aborts would fail with ContextTerminated).
        self._finalizer.detach()
        threading.Thread(target=term_after, args=(self._ctx, closing), name="mii_async-client-close",
                         daemon=True).start()
        if self._sync_loop is not None:
            # Not at once: close() may be running on that loop, inside a coroutine whose result is still to
            # be handed to the waiting thread, and other threads' coroutines end (their streams failed) first.
            asyncio.run_coroutine_threadsafe(stop_when_idle(), self._sync_loop)

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
