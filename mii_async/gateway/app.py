"""create_app: the gateway's FastAPI app over a GatewayState."""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .auth import APIKeyMiddleware
from .body_limit import BodyLimitMiddleware
from .host_check import AllowedHosts, HostCheckMiddleware
from .http_errors import HTTPError, bad_request
from .sse import ClientGone
from .state import GatewayState

log = logging.getLogger("mii_async.gateway")
_STARLETTE_CODES = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed"),
                    413: ("invalid_request_error", "request_too_large")}


# A step of pydantic's error location that names a member of a union (`str`, `list[str]`,
# `function-after[...]`), not a field of the request.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|bytes|list|dict|tuple|set|none|any)$|^[a-z-]+\[.*\]$")


def param_name(loc, keep_last: bool = False) -> str | None:
    """pydantic's location of an error → the parameter as the caller wrote it: `messages[0].content`.
    `keep_last`: the last step is a field the caller sent (an unknown one), whatever it looks like."""
    steps = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for i, x in enumerate(steps):
        if isinstance(x, int):
            out += f"[{x}]"
        elif not _UNION_MEMBER.search(str(x)) or (keep_last and i == len(steps) - 1):
            out += f".{x}" if out else str(x)
    return out or None


def create_app(state: GatewayState) -> FastAPI:
    """The app; `state.start()` runs in its lifespan (the router must answer then)."""
    from contextlib import asynccontextmanager

    from . import batch_routes, ops, openai_routes, responses_routes, rest, tokenize_routes, ui, ws
    from .responses_store import MemoryResponseStore

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        await app.state.jobs.start()          # resumes the batches left unfinished in jobs_dir
        yield
        await app.state.jobs.close()
        state.close()

    app = FastAPI(title="mii_async gateway", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.gateway = state
    app.state.responses = MemoryResponseStore()       # the Responses API's stored responses (store: true)
    app.state.jobs = batch_routes.Jobs(app)           # the Files and Batches API's store and runner (jobs_dir)
    state.metrics.jobs.source = app.state.jobs.counts  # its figures in /metrics, read at each scrape
    for r in (ops.router, openai_routes.router, responses_routes.router, tokenize_routes.router, rest.router,
              ws.router, ui.router, batch_routes.router):
        app.include_router(r)
    app.mount("/static", ui.static_files(), name="static")

    @app.exception_handler(HTTPError)
    async def on_http_error(request: Request, exc: HTTPError) -> JSONResponse:
        if not exc.counted:
            state.metrics.refused(request.url.path, exc.code)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        state.metrics.refused(request.url.path, "invalid_parameter")
        err = exc.errors()[0] if exc.errors() else {}
        param = param_name(err.get("loc", ()), keep_last=err.get("type") == "extra_forbidden")
        if err.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif err.get("type") == "json_invalid":
            param, message = None, f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}".rstrip(": ")
        else:
            message = f"{param}: {err.get('msg', 'invalid value')}" if param else err.get("msg", "invalid request")
        return bad_request(param, message).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind, code = _STARLETTE_CODES.get(exc.status_code, ("invalid_request_error", "invalid_request"))
        if exc.status_code == 413:
            state.metrics.refused(request.url.path, code)
        response = HTTPError(exc.status_code, str(exc.detail), kind, None, code).response()
        response.headers.update(exc.headers or {})           # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug of ours, or a library's (a chat template that raises): an answer in OpenAI's shape, not a
        # plain-text 500; the traceback goes to the log.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        state.metrics.refused(request.url.path, "internal_error")
        return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error", None,
                         "internal_error").response()

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)      # gone while it sent its body: not a fault of ours
    async def on_client_gone(_: Request, __: Exception) -> Response:
        return Response(status_code=499)          # nobody reads it: the client has gone

    app.add_middleware(BodyLimitMiddleware, max_bytes=state.config.max_body_bytes,
                       on_refuse=lambda path: state.metrics.refused(path, "request_too_large"))
    if state.config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.config.api_key)
    # Added last, so outermost: a rebound name is refused before anything else answers it.
    app.state.allowed_hosts = AllowedHosts(state.config.http_host, state.config.allowed_hosts)
    app.add_middleware(HostCheckMiddleware, hosts=app.state.allowed_hosts)
    return app
