"""JobClient: the Batch API's store from Python, without HTTP — `client.jobs`.

    batch = client.jobs.submit("requests.jsonl")          # or a list of request lines (dicts)
    for line in client.jobs.results(batch["id"]):         # each finished line as it lands, until the batch ends
        print(line["custom_id"], line["response"]["body"])
    async for b in client.jobs.progress(batch["id"]):     # the batch after each change of status or counts
        print(b["status"], b["request_counts"])

Every method runs from plain code (blocking; an iterator with `for`) and from a coroutine (await it; `async for`),
as the client's own methods do (sync_facade.py). Batches and lines are OpenAI's: `submit`, `get`, `list` and
`cancel` give the Batch object (a dict, as `GET /v1/batches/{id}` answers), `results` each output line
(`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`).

Where the lines run: in the process that holds the directory's runner lease (runner_lease.py). A gateway that
opened the directory holds it, and runs what this client submits; when no process holds it, this client takes
it and runs the lines here, each through the gateway's own route called in process (batch_routes.call_app, on
an app built over this client: no socket), on a loop thread of its own, so they go on while the caller does
other things; the expiry sweep runs there too (expiry.start_jobs, as in a gateway). The store is durable: lines
left unfinished when this process exits run again wherever the lease is taken next. A JobClient without a client
(the `mii-async batch` command's) only submits, reads and cancels.

Limits: `submit` refuses what the gateway's upload and batch routes refuse, with the same JobLimitError naming the
bound (limits.py). `http`, the HttpConfig of the gateway that serves the directory, gives its bounds, model name
and leniency to the checks here and to the lines run here; without it they are HttpConfig's defaults.

Concurrency: any thread or loop may call it; lines run on its own loop thread. Cancellation: leaving a
`results`/`progress` iteration early leaves the batch running; `cancel(id)` stops it, in whichever process runs
it. Closing: `close()` (also done by the client's `close()`) stops this process's runner, whose lines in flight
are aborted and stay pending for the next runner, and releases the directory.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import os
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Coroutine, TypeVar

from ..errors import EngineClosedError, InvalidParameterError
from ..sync_facade import DualStream, dual
from .batch_input import parse_batch_input
from .batch_runner import BatchRunner
from .expiry import Expiry, start_jobs
from .limits import (COMPLETION_WINDOWS, JobLimits, check_file_size, check_line_count, check_room,
                     request_line_count)
from .openai_objects import batch_object
from .store import TERMINAL, JobStore

if TYPE_CHECKING:
    from ..async_client import AsyncClient
    from ..config import HttpConfig

T = TypeVar("T")
POLL_S = 0.25                # how often results() and progress() read the store
MAX_LISTED_ERRORS = 3        # of a refused input's faults, the message quotes this many (`.errors` has all)


class JobClient:
    def __init__(self, client: AsyncClient | None, jobs_dir: str, limits: JobLimits | None = None, *,
                 http: HttpConfig | None = None) -> None:
        """`limits`: None takes `http`'s (JobLimits.from_config), else JobLimits' defaults."""
        self.client, self.jobs_dir, self.http = client, os.path.abspath(jobs_dir), http
        self.limits = limits or (JobLimits.from_config(http) if http is not None else JobLimits())
        self._lock = threading.RLock()       # RLock: a done callback may run at once, in the thread holding it
        self._loop: asyncio.AbstractEventLoop | None = None     # the loop thread that runs lines and sync calls
        self._thread: threading.Thread | None = None
        self._started: concurrent.futures.Future | None = None
        self._store: JobStore | None = None
        self._runner: BatchRunner | None = None
        self._expiry: Expiry | None = None
        self._check: Any = None       # the gateway's check of a line's body (batch_routes.check_body), with a client
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def runs_lines(self) -> bool:
        """Whether this process runs the directory's lines now (it holds the runner lease)."""
        return self._store is not None and self._store.owns

    # -- the API -------------------------------------------------------------------------------------
    @dual
    async def submit(self, lines: Any, *, endpoint: str = "/v1/chat/completions",
                     metadata: dict[str, str] | None = None) -> dict:
        """Stores the request lines as a batch's input file and the batch (status validating); the runner then
        runs them. `lines`: a list of dicts `{"custom_id", "body"}` (`method` POST and `url` = `endpoint` when
        absent), or the path (or bytes) of a JSONL file in OpenAI's batch input format. Every line is checked
        first, as the gateway checks a batch's file: a bad line raises InvalidParameterError naming it
        (`lines[i].body.max_tokens` for a list, the 1-based line in the message for a file; `.errors` lists
        every fault) and nothing is stored. An input past the limits raises JobLimitError naming `lines` and
        the bound, in the routes' order: max_file_bytes and max_stored_bytes (the upload's 413), max_lines
        (the batch's 400)."""
        from ..gateway.batch_routes import ENDPOINTS, check_metadata

        store = await self._ready()
        if endpoint not in ENDPOINTS:
            raise InvalidParameterError("endpoint", f"must be one of {sorted(ENDPOINTS)}, got {endpoint!r}")
        check_metadata(metadata)
        data, filename, listed = await asyncio.to_thread(_input_bytes, lines, endpoint)
        check_file_size(self.limits, len(data), param="lines")
        check_room(self.limits, await asyncio.to_thread(store.stored_bytes), len(data), param="lines")
        check_line_count(self.limits, await asyncio.to_thread(request_line_count, data), param="lines")
        check = self._check or _shape_only
        _, errors = await asyncio.to_thread(parse_batch_input, data, endpoint, check, self.limits.max_lines)
        if errors:
            raise _refusal(errors, listed)
        file = await asyncio.to_thread(store.add_file, filename, "batch", data)
        row = await asyncio.to_thread(store.add_batch, file["id"], endpoint, "24h", metadata,
                                      COMPLETION_WINDOWS["24h"])
        self._poke()
        return batch_object(row)

    @dual
    async def get(self, batch_id: str) -> dict:
        """The batch now; InvalidParameterError naming batch_id when the directory holds no such batch."""
        return batch_object(await self._row(batch_id))

    @dual
    async def list(self, after: str | None = None, limit: int = 20) -> list[dict]:
        """The batches, newest first: at most `limit` (1 to 100), those after the batch `after` in that order."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100:
            raise InvalidParameterError("limit", f"must be an integer from 1 to 100, got {limit!r}")
        store = await self._ready()
        rows, _ = await asyncio.to_thread(store.list_batches, after, limit)
        return [batch_object(r) for r in rows]

    @dual
    async def cancel(self, batch_id: str) -> dict:
        """Stops a batch that has not ended: no further line starts, those in flight are aborted (within
        POLL_S when another process runs them), and it ends as cancelled with the lines that had finished. A
        batch that has ended raises InvalidParameterError naming batch_id (the HTTP route's 409)."""
        store = await self._ready()
        row = await self._row(batch_id)
        if row["status"] in TERMINAL:
            raise InvalidParameterError("batch_id", f"the batch {batch_id} has ended ({row['status']}): it cannot "
                                        "be cancelled")
        await asyncio.to_thread(store.set_status, batch_id, "cancelling", "cancelling_at",
                                ("validating", "in_progress"))
        self._poke()
        return batch_object(await self._row(batch_id))

    def results(self, batch_id: str) -> DualStream:
        """Each finished line of the batch (OpenAI's output line, 2xx answers and errors alike), in the order
        they finished, from the first; ends when the batch has ended and its last line was given. A batch that
        failed validation raises InvalidParameterError quoting its errors."""
        return DualStream(self._results(batch_id), self)

    def progress(self, batch_id: str) -> DualStream:
        """The batch (OpenAI's object) now, then after each change of its status or request_counts; the last one
        given is the batch as it ended."""
        return DualStream(self._progress(batch_id), self)

    async def _results(self, batch_id: str) -> AsyncIterator[dict]:
        store = await self._ready()
        await self._row(batch_id)
        after = -1
        while True:
            row = await asyncio.to_thread(store.get_batch, batch_id)      # before the lines: none is missed
            for seq, line in await asyncio.to_thread(store.results_since, batch_id, after):
                after = seq
                yield line
            if row["status"] in TERMINAL:
                if row["status"] == "failed":
                    raise _refusal(json.loads(row["errors"] or "[]"), listed=False, batch_id=batch_id)
                return
            await asyncio.sleep(POLL_S)

    async def _progress(self, batch_id: str) -> AsyncIterator[dict]:
        last = None
        while True:
            b = batch_object(await self._row(batch_id))
            seen = (b["status"], tuple(b["request_counts"].values()))
            if seen != last:
                last = seen
                yield b
            if b["status"] in TERMINAL:
                return
            await asyncio.sleep(POLL_S)

    async def _row(self, batch_id: str) -> dict:
        store = await self._ready()
        row = await asyncio.to_thread(store.get_batch, batch_id)
        if row is None:
            raise InvalidParameterError("batch_id", f"no batch {batch_id!r} in {self.jobs_dir}")
        return row

    # -- the store, the runner and the loop thread --------------------------------------------------------
    async def _ready(self) -> JobStore:
        """Opens the store, and with a client starts the runner on this JobClient's loop, once."""
        with self._lock:
            if self._closed:
                raise EngineClosedError("the job client is closed")
            if self._started is None:
                self._started = asyncio.run_coroutine_threadsafe(self._start(), self._own_loop())
                self._started.add_done_callback(self._forget_failed_start)
            started = self._started
        await asyncio.wrap_future(started)
        assert self._store is not None, "the store opens before _start returns"
        return self._store

    def _forget_failed_start(self, fut: concurrent.futures.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            with self._lock:
                if self._started is fut:           # the next call tries again (a directory it could not create)
                    self._started = None

    async def _start(self) -> None:
        if self._store is None:
            self._store = await asyncio.to_thread(JobStore, self.jobs_dir, exclusive=False)
        if self.client is None:
            return
        from ..config import HttpConfig
        from ..gateway.app import create_app
        from ..gateway.batch_routes import check_body, send_line
        from ..gateway.state import GatewayState

        http = HttpConfig(jobs_dir=self.jobs_dir) if self.http is None else \
            dataclasses.replace(self.http, jobs_dir=self.jobs_dir)
        app = create_app(GatewayState(self.client, http))
        await app.state.gateway.health(fresh=True)   # the served model's name, which a line's `model` must match
        self._check = check_body(app)
        self._runner = BatchRunner(self._store, functools.partial(send_line, app), self._check, self.limits)
        self._expiry = Expiry(self._store, self._runner, self.limits)
        start_jobs(self._runner, self._expiry)

    def _own_loop(self) -> asyncio.AbstractEventLoop:
        """This JobClient's loop thread, started at the first need (call with self._lock held)."""
        if self._loop is None:
            from ..client_loops import run_loop

            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=run_loop, args=(self._loop,), name="mii_async-jobs", daemon=True)
            self._thread.start()
        return self._loop

    def _poke(self) -> None:
        """Tells this process's runner, when it runs lines, to read the store now."""
        if self._runner is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._runner.poke)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs one of this JobClient's coroutines from plain code, on its loop thread (the sync facade)."""
        with self._lock:
            if self._closed:
                coro.close()
                raise EngineClosedError("the job client is closed")
            loop = self._own_loop()
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()                          # Ctrl-C: the coroutine stops too
            raise

    def close(self) -> None:
        """Stops this process's runner (lines in flight stay pending for whichever process runs them next),
        closes the store, releasing the lease, and the loop thread. Idempotent; later calls raise
        EngineClosedError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None:
            return
        if threading.current_thread() is thread:    # from this loop's own thread: it cannot wait for itself
            loop.create_task(self._shutdown()).add_done_callback(lambda _: loop.stop())
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(30.0)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30.0)

    async def _shutdown(self) -> None:
        if self._started is not None:
            await asyncio.gather(asyncio.wrap_future(self._started), return_exceptions=True)
        if self._expiry is not None:
            await self._expiry.close()
        if self._runner is not None:
            await self._runner.close()
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> JobClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def served_jobs_dir(served: Any, jobs_dir: str | None) -> tuple[str, Any]:
    """The absolute jobs directory a client's JobClient uses — `jobs_dir`, else that of the gateway its serve()
    started (`served`, an HttpConfig or None), else the default — and that gateway's HttpConfig when the
    directory is the gateway's own (its limits, model name and leniency apply), else None."""
    if jobs_dir is None:
        jobs_dir = served.jobs_dir if served is not None else default_jobs_dir()
    path = os.path.abspath(jobs_dir)
    if served is not None and os.path.abspath(served.jobs_dir) != path:
        served = None
    return path, served


def default_jobs_dir() -> str:
    """The gateway's default directory (HttpConfig.jobs_dir), absolute."""
    from ..config import HttpConfig

    return os.path.abspath(HttpConfig().jobs_dir)


def _input_bytes(lines: Any, endpoint: str) -> tuple[bytes, str, bool]:
    """The JSONL bytes of `lines`, the input file's name, and whether they came as a list."""
    if isinstance(lines, (str, os.PathLike)):
        try:
            with open(lines, "rb") as f:
                return f.read(), os.path.basename(os.fspath(lines)), False
        except OSError as exc:
            raise InvalidParameterError("lines", f"cannot read {os.fspath(lines)!r}: {exc.strerror}") from None
    if isinstance(lines, (bytes, bytearray)):
        return bytes(lines), "input.jsonl", False
    if not isinstance(lines, (list, tuple)):
        raise InvalidParameterError("lines", "must be a list of request lines (dicts), or a JSONL file's path or "
                                    f"bytes, not {type(lines).__name__}")
    out = []
    for i, line in enumerate(lines):
        if not isinstance(line, dict):
            raise InvalidParameterError(f"lines[{i}]", "must be a dict: {'custom_id': …, 'body': {…}}")
        try:
            out.append(json.dumps({"method": "POST", "url": endpoint, **line}))
        except (TypeError, ValueError) as exc:
            raise InvalidParameterError(f"lines[{i}]", f"is not JSON: {exc}") from None
    return "".join(x + "\n" for x in out).encode(), "lines.jsonl", True


def _shape_only(url: str, body: dict) -> None:
    """Without a client there is no gateway's check of a body: the runner's process checks it."""
    return None


def _refusal(errors: list[dict], listed: bool, batch_id: str | None = None) -> InvalidParameterError:
    """The first fault of an input as the error to raise: its parameter (with the list index when the lines came
    as a list), every fault under `.errors` ({code, message, param, line}, lines 1-based)."""
    first = errors[0] if errors else {"line": None, "param": None, "message": "the batch failed validation"}
    param = first.get("param")
    if listed and first.get("line") is not None:
        param = f"lines[{first['line'] - 1}]" + (f".{param}" if param else "")
    shown = "; ".join(e["message"] for e in errors[:MAX_LISTED_ERRORS])
    more = f" (and {len(errors) - MAX_LISTED_ERRORS} more)" if len(errors) > MAX_LISTED_ERRORS else ""
    where = f"the batch {batch_id} failed validation: " if batch_id else ""
    exc = InvalidParameterError(param or "lines", f"{where}{shown or first['message']}{more}")
    exc.errors = errors
    return exc
