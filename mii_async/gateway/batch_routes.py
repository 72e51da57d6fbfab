"""The OpenAI Files and Batches API: POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET /v1/files/{id}/content;
POST/GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel (docs/jobs.md).

The state lives in a JobStore under HttpConfig.jobs_dir, opened at the gateway's start when that directory holds
one (its unfinished batches then resume at once), else at the first request of these routes — a gateway never
asked for a batch leaves no files behind. Other processes may use the same directory (a client's `jobs` API,
`mii-async batch`, another gateway): the one holding the directory's lease runs every batch's lines, whichever
process submitted it (jobs/batch_runner.py). Each batch line is answered by the gateway's own route for the batch's
endpoint, called in process through the app (the same validation, router client, errors and answer as over
HTTP), so a line's response body is exactly what `POST /v1/chat/completions` or `/v1/completions` would send.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..errors import InvalidParameterError, MIIAsyncError
from ..jobs.batch_input import BodyCheck
from ..jobs.batch_runner import BatchRunner
from ..jobs.expiry import Expiry, start_jobs, upload_expires_after
from ..jobs.limits import (COMPLETION_WINDOWS, JobLimitError, JobLimits, check_file_size, check_line_count,
                           check_room, request_line_count)
from ..jobs.openai_objects import batch_object, file_object, page
from ..jobs.stats import JobCounts, JobStats
from ..jobs.store import TERMINAL, JobStore
from ..jobs.upload import parse_upload
from ..text.unicode_text import check_json_text
from .http_errors import HTTPError, bad_request, from_exception
from .openai_schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("mii_async.gateway")
router = APIRouter()
ENDPOINTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
MAX_METADATA_PAIRS = 16      # OpenAI's bounds on a batch's metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
BATCH_PRIORITY = 1           # vLLM's priority (lower first) of a batch line whose body gives none


class Jobs:
    """The gateway's store, runner and expiry sweep, opened on first need; `close()` stops the sweep and the
    runner (lines in flight stay pending) and releases the directory."""

    def __init__(self, app: FastAPI, limits: JobLimits | None = None) -> None:
        self.config = app.state.gateway.config
        self.app, self.limits = app, limits or JobLimits.from_config(self.config)
        self.store: JobStore | None = None
        self.runner: BatchRunner | None = None
        self.expiry: Expiry | None = None
        self.stats: JobStats | None = None

    def open(self) -> tuple[JobStore, BatchRunner]:
        if self.store is None:
            try:
                store = JobStore(self.config.jobs_dir, exclusive=False)
            except MIIAsyncError as exc:
                raise from_exception(exc) from None
            self.store = store
            self.runner = BatchRunner(store, self._send, check_body(self.app), self.limits)
            self.expiry = Expiry(store, self.runner, self.limits)
            start_jobs(self.runner, self.expiry)
            self.stats = JobStats(store, self.runner, self.expiry, self.limits)
        return self.store, self.runner

    def counts(self) -> JobCounts | None:
        """/metrics' figures: zeros while jobs_dir holds no store; None where it holds one not open here."""
        if self.stats is not None:
            return self.stats.read()
        return None if JobStore.exists(self.config.jobs_dir) else JobCounts.empty(self.limits)

    async def start(self) -> None:
        """At the gateway's start: resumes the batches of a directory that holds a store."""
        if JobStore.exists(self.config.jobs_dir):
            try:
                self.open()
            except HTTPError as exc:
                log.error("the Files and Batches API is unavailable: %s", exc.message)

    async def close(self) -> None:
        if self.expiry is not None:
            await self.expiry.close()
        if self.runner is not None:
            await self.runner.close()
        if self.store is not None:
            self.store.close()

    async def _send(self, url: str, body: dict) -> tuple[int, Any]:
        return await send_line(self.app, url, body)


async def send_line(app: FastAPI, url: str, body: dict) -> tuple[int, Any]:
    """One batch line through the app's route for `url`, in this process: the HTTP status and the JSON body."""
    if "priority" not in body:                # behind interactive requests (priority 0) in a replica's queue
        body = {**body, "priority": BATCH_PRIORITY}
    status, raw = await call_app(app, url, body, app.state.gateway.config.api_key)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"error": {"message": raw.decode("utf-8", "replace"), "type": "internal_error",
                                  "param": None, "code": "internal_error"}}


async def call_app(app: FastAPI, path: str, body: dict, api_key: str | None) -> tuple[int, bytes]:
    """POSTs a JSON body to the app itself (its middlewares and route), in this process; its status and body.
    Cancelling it cancels the route, which aborts its requests as a client's disconnect does."""
    raw = json.dumps(body).encode()         # ASCII: a lone surrogate reaches the route's own check, escaped
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"content-length", str(len(raw)).encode())]
    if api_key:
        headers.append((b"authorization", f"Bearer {api_key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "extensions": {}}
    answered = asyncio.Event()
    given = False
    status, chunks = 500, []

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await answered.wait()                 # the route watches for a disconnect: none comes until it answered
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                answered.set()

    try:
        await app(scope, receive, send)
    finally:
        answered.set()
    return status, b"".join(chunks)


def check_body(app: FastAPI) -> BodyCheck:
    """What the route refuses of a body before it reaches the router: its schema, `stream`, another model's
    name, and (completions) the fields the gateway does not support. Safe to call from a thread."""
    from .openai_params import chat_messages, completion_jobs

    state = app.state.gateway

    def check(url: str, body: dict) -> tuple[str | None, str] | None:
        cls = ENDPOINTS[url]
        if state.config.lenient_requests:     # as the route does with --lenient-requests: unknown fields dropped
            known = {f.alias or name for name, f in cls.model_fields.items()}
            body = {k: v for k, v in body.items() if k in known}
        if body.get("stream"):
            return "stream", "stream must be false in a batch: each line's answer is one JSON body"
        model = body.get("model")
        if model is not None and state.model_name and model != state.model_name:
            return "model", f"the model '{model}' does not exist; this server serves '{state.model_name}'"
        try:
            parsed = cls.model_validate(body)
            if isinstance(parsed, CompletionRequest):
                completion_jobs(parsed)
            else:
                chat_messages(parsed.messages)
        except ValidationError as exc:
            from .app import param_name

            err = exc.errors()[0]
            param = param_name(err.get("loc", ()), keep_last=err.get("type") == "extra_forbidden")
            return param, f"{param}: {err.get('msg', 'invalid value')}" if param else err.get("msg", "invalid")
        except HTTPError as exc:
            return exc.param, exc.message
        except InvalidParameterError as exc:
            return exc.param, str(exc)
        return None

    return check


def _jobs(request: Request) -> tuple[JobStore, BatchRunner]:
    return request.app.state.jobs.open()


def _file(request: Request, row: dict) -> dict[str, Any]:
    """The File object of a store row, with the time the expiry sweep deletes it."""
    return file_object(row, request.app.state.jobs.expiry.file_expires_at(row))


def _not_found(what: str, id_: str, param: str) -> HTTPError:
    return HTTPError(404, f"No such {what}: '{id_}'", "invalid_request_error", param, "not_found")


def _refused(exc: JobLimitError) -> HTTPError:
    return HTTPError(exc.status, str(exc), "invalid_request_error", exc.param, exc.code)


def _limit(limit: int, most: int) -> int:
    if not 1 <= limit <= most:
        raise bad_request("limit", f"limit must be between 1 and {most}, got {limit}")
    return limit


@router.post("/v1/files")
async def upload_file(request: Request) -> JSONResponse:
    store, _ = _jobs(request)
    limits: JobLimits = request.app.state.jobs.limits
    raw = await request.body()
    try:
        upload = parse_upload(request.headers.get("content-type", ""), raw)
    except InvalidParameterError as exc:
        raise from_exception(exc) from None
    if upload.purpose != "batch":
        raise bad_request("purpose", f"purpose must be 'batch' (the one use of files here), got {upload.purpose!r}")
    if not upload.data.strip():
        raise bad_request("file", "the file is empty")
    try:
        check_file_size(limits, len(upload.data))
        expires_after = upload_expires_after(request.headers.get("content-type", ""), raw)
        check_room(limits, store.stored_bytes(), len(upload.data))   # no await from here to the write
    except JobLimitError as exc:
        raise _refused(exc) from None
    except InvalidParameterError as exc:
        raise from_exception(exc) from None
    row = store.add_file(upload.filename, upload.purpose, upload.data, expires_after)
    return JSONResponse(_file(request, row))


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = 10_000) -> JSONResponse:
    store, _ = _jobs(request)
    rows = store.list_files(purpose)
    if after is not None:
        ids = [r["id"] for r in rows]
        if after not in ids:
            raise bad_request("after", f"no file {after!r}")
        rows = rows[ids.index(after) + 1:]
    n = _limit(limit, 10_000)
    return JSONResponse(page([_file(request, r) for r in rows[:n]], len(rows) > n))


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> JSONResponse:
    store, _ = _jobs(request)
    row = store.get_file(file_id)
    if row is None:
        raise _not_found("file", file_id, "file_id")
    return JSONResponse(_file(request, row))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    store, _ = _jobs(request)
    if store.get_file(file_id) is None:
        raise _not_found("file", file_id, "file_id")
    return Response(store.read_file(file_id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    store, _ = _jobs(request)
    if not store.delete_file(file_id):
        raise _not_found("file", file_id, "file_id")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@router.post("/v1/batches")
async def create_batch(request: Request) -> JSONResponse:
    store, runner = _jobs(request)
    raw = await request.body()
    try:
        body = json.loads(raw)
        check_json_text(raw, body)              # a lone surrogate in metadata: a 400 naming it
    except InvalidParameterError as exc:
        raise from_exception(exc) from None
    except ValueError as exc:
        raise bad_request(None, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(None, "the body must be a JSON object")
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
    if unknown:
        raise bad_request(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")
    file_id, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
    if not isinstance(file_id, str) or store.get_file(file_id) is None:
        raise _not_found("file", str(file_id), "input_file_id")
    if store.get_file(file_id)["purpose"] != "batch":
        raise bad_request("input_file_id", f"the file {file_id} was not uploaded with purpose 'batch'")
    if endpoint not in ENDPOINTS:
        raise bad_request("endpoint", f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}")
    if window not in COMPLETION_WINDOWS:
        raise bad_request("completion_window", f"completion_window must be one of {sorted(COMPLETION_WINDOWS)}, "
                          f"got {window!r}")
    metadata = body.get("metadata")
    try:
        check_metadata(metadata)
    except InvalidParameterError as exc:
        raise from_exception(exc) from None
    loop = asyncio.get_running_loop()
    try:
        data = await loop.run_in_executor(None, store.read_file, file_id)
        check_line_count(request.app.state.jobs.limits, await loop.run_in_executor(None, request_line_count, data))
    except FileNotFoundError:                  # deleted meanwhile
        raise _not_found("file", file_id, "input_file_id") from None
    except JobLimitError as exc:
        raise _refused(exc) from None
    row = store.add_batch(file_id, endpoint, window, metadata, COMPLETION_WINDOWS[window])
    runner.submit(row["id"])
    return JSONResponse(batch_object(row))


def check_metadata(metadata: Any) -> None:
    """A batch's metadata within OpenAI's bounds; InvalidParameterError naming the key otherwise."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidParameterError("metadata", f"must be an object of at most {MAX_METADATA_PAIRS} string pairs")
    for k, v in metadata.items():
        if not isinstance(k, str) or len(k) > MAX_METADATA_KEY or not isinstance(v, str) or \
                len(v) > MAX_METADATA_VALUE:
            raise InvalidParameterError(f"metadata.{k}", f"keys are strings of at most {MAX_METADATA_KEY} "
                                        f"characters and values strings of at most {MAX_METADATA_VALUE}")


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> JSONResponse:
    store, _ = _jobs(request)
    try:
        rows, more = store.list_batches(after, _limit(limit, 100))
    except InvalidParameterError as exc:
        raise from_exception(exc) from None
    return JSONResponse(page([batch_object(r) for r in rows], more))


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> JSONResponse:
    store, _ = _jobs(request)
    row = store.get_batch(batch_id)
    if row is None:
        raise _not_found("batch", batch_id, "batch_id")
    return JSONResponse(batch_object(row))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    store, runner = _jobs(request)
    row = store.get_batch(batch_id)
    if row is None:
        raise _not_found("batch", batch_id, "batch_id")
    if row["status"] in TERMINAL:
        raise HTTPError(409, f"the batch {batch_id} has ended ({row['status']}): it cannot be cancelled",
                        "invalid_request_error", "batch_id", "batch_not_cancellable")
    return JSONResponse(batch_object(runner.cancel(batch_id)))
