"""DeepSpeed-MII's REST API: POST /generate, POST /mii/{deployment_name}, and GET /terminate where enabled.

    curl -X POST http://localhost:8000/generate -d '{"prompts": ["DeepSpeed is"], "max_new_tokens": 128}'
    → [{"generated_text": …, "prompt_length": …, "generated_length": …, "finish_reason": …}]

The body is JSON whatever its Content-Type says: `curl -d` sends it as a form, and the seed document's and
DeepSpeed-MII's examples send it so. `prompts` is a string, or a list of strings, token-id lists or
chat-message lists; every other key is a sampling parameter by mii_async's names, or DeepSpeed-MII's
`max_length` (prompt and output tokens in all); an unknown one is a 400 naming it, and one we cannot honour
(num_beams, …) a 400 naming the nearest supported one (mii_params.py). `/mii/{deployment_name}` answers
for the served model's name and for the name the deployment was served under (`serve(deployment_name=…)`,
found in the host's deployment registry). `GET /terminate` stops the deployment (its router drains for up to
TERMINATE_DRAIN_S, then every process exits; the gateway too, when serve() started it); it answers only when
serve() was asked for it (`enable_terminate=True`), and like every route wants the API key when one is set;
a browser's cross-site request for it is refused (403), so that a web page cannot stop the deployment.

With `logprobs` or `prompt_logprobs` asked, each answer also has them: `logprobs` one `{"token_id",
"logprob", "top": [[id, logprob], …]}` per generated token, `prompt_logprobs` one per prompt token, null for
the first. `"stream": true` answers with server-sent events — `{"index", "text", "token_ids",
"finish_reason", "usage"}` per streamed step of each prompt, with `logprobs` when asked and
`prompt_logprobs` on the first step's — ending in `data: [DONE]`; an error in the middle is
`data: {"error": …}`.
"""
from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Body, Request

from .. import deployment_registry as registry
from ..errors import GenerationError, MIIAsyncError, PermissionDeniedError
from ..mii_params import check_max_length, check_names, length_request
from ..params import SamplingParams
from ..text.prompts import is_messages, is_token_ids
from .http_errors import HTTPError, bad_request, from_exception
from .sse import DONE, EventStream, event, until_disconnect
from .state import GatewayState
from .streams import Job, Opened, collect, merge, open_streams
from .text_route import CheckedRoute

router = APIRouter(route_class=CheckedRoute)
MAX_PROMPTS = 1024
TERMINATE_DRAIN_S = 10.0    # GET /terminate: how long live requests get to finish


@router.post("/generate")
async def generate(request: Request, body: Any = Body(...)):
    return await _generate(request.app.state.gateway, request, body)


@router.post("/mii/{deployment_name}")
async def mii_generate(deployment_name: str, request: Request, body: Any = Body(...)):
    s: GatewayState = request.app.state.gateway
    entry = registry.find_by_address(s.client.address)
    names = [n for n in (entry.name if entry else None, s.model_name) if n]
    if deployment_name not in names:
        raise HTTPError(404, f"no deployment named '{deployment_name}'; this server answers for "
                        f"{' and '.join(repr(n) for n in names)}", "not_found_error", "deployment_name",
                        "model_not_found")
    return await _generate(s, request, body)


@router.get("/terminate")
async def terminate(request: Request):
    s: GatewayState = request.app.state.gateway
    entry = registry.find_by_address(s.client.address)
    if entry is None or not entry.terminate_route:
        raise HTTPError(404, "GET /terminate is off: serve(..., enable_terminate=True) turns it on",
                        "not_found_error", None, "not_found")
    if request.headers.get("sec-fetch-site") in ("cross-site", "same-site"):
        raise HTTPError(403, "GET /terminate is refused to a cross-site browser request", "permission_error",
                        None, "cross_site")
    try:
        await s.client.terminate_server(TERMINATE_DRAIN_S)
    except PermissionDeniedError as exc:
        raise HTTPError(403, str(exc), "permission_error", None, "permission_denied") from None
    except MIIAsyncError as exc:
        raise from_exception(exc) from None
    return {"message": f"the deployment is stopping: live requests get up to {TERMINATE_DRAIN_S:g} s to finish"}


def _jobs(body: Any) -> tuple[list[Job], bool]:
    if isinstance(body, (bytes, bytearray)):       # JSON sent as a form (`curl -d`) or with no type
        try:
            body = json.loads(body)
        except (ValueError, RecursionError):
            raise bad_request(None, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request(None, "the body must be a JSON object")
    body = dict(body)
    if "prompts" not in body:
        raise bad_request("prompts", "prompts is required: a string or a list of prompts")
    prompts = body.pop("prompts")
    stream = body.pop("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream", "stream must be true or false")
    if isinstance(prompts, str) or is_token_ids(prompts) or is_messages(prompts):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROMPTS:
        raise bad_request("prompts", f"prompts must be a string or a list of 1 to {MAX_PROMPTS} prompts")
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) and p) and not is_token_ids(p) and not is_messages(p):
            raise bad_request(f"prompts[{i}]", "each prompt is a non-empty string, token ids or chat messages")
    try:
        check_names(body, stream_keyword=False)
        if "max_length" in body:                     # DeepSpeed-MII's; client.stream cuts the answer there
            params = length_request({k: v for k, v in body.items() if k != "max_length"},
                                    check_max_length(body["max_length"]))
        else:
            params = body
        SamplingParams.from_kwargs(**params)
    except MIIAsyncError as exc:
        raise from_exception(exc) from None
    return [Job(i, i, p, body) for i, p in enumerate(prompts)], stream


async def _generate(s: GatewayState, request: Request, body: Any):
    jobs, stream = _jobs(body)
    try:
        opened = await until_disconnect(request, open_streams(s, "generate", jobs))
    except MIIAsyncError as exc:
        raise _refused(exc, jobs) from None
    if stream:
        return EventStream(_events(opened))
    try:
        chunks = await until_disconnect(request, collect(opened))
    except MIIAsyncError as exc:
        raise from_exception(exc, counted=True) from None
    out = []
    for o in opened:
        cs = chunks[o.job.index]
        last = cs[-1]
        if last.finish_reason == "error":
            raise from_exception(GenerationError(last.error or "generation failed"), counted=True)
        text = "".join(c.text for c in cs)
        if o.job.params.get("return_full_text") and isinstance(o.job.prompt, str):
            text = o.job.prompt + text
        u = last.usage
        answer = {"generated_text": text, "prompt_length": u.prompt_tokens if u else 0,
                  "generated_length": sum(len(c.token_ids) for c in cs), "finish_reason": last.finish_reason}
        if o.job.params.get("logprobs") is not None:
            answer["logprobs"] = [lp.to_dict() for c in cs for lp in c.logprobs or ()]
        if o.job.params.get("prompt_logprobs") is not None:
            plps = next((c.prompt_logprobs for c in cs if c.prompt_logprobs is not None), None)
            answer["prompt_logprobs"] = _logprobs_json(plps)
        out.append(answer)
    return out


def _refused(exc: MIIAsyncError, jobs: list[Job]) -> HTTPError:
    """The answer to a prompt the router refused, naming it as the body does: `prompts` (one), `prompts[i]`
    (the router says `prompt`, or `messages…` for a chat prompt, whose message index follows)."""
    at = "prompts"
    if len(jobs) > 1 and isinstance(job := getattr(exc, "job", None), Job):
        at = f"prompts[{job.index}]"
    param = getattr(exc, "param", None)
    if param == "prompt" or (isinstance(param, str) and param.startswith("messages")):
        theirs = at + ("" if param == "prompt" else param[len("messages"):])
        return from_exception(exc, {param: theirs}, counted=True)
    return from_exception(exc, counted=True)


def _logprobs_json(lps: list | None) -> list | None:
    return None if lps is None else [lp and lp.to_dict() for lp in lps]


async def _events(opened: list[Opened]) -> AsyncIterator[str]:
    async with aclosing(merge(opened)) as items:
        async for job, c in items:
            if isinstance(c, Exception):
                yield event(from_exception(c).body())
                continue
            if c.finish_reason == "error":
                yield event(from_exception(GenerationError(c.error or "generation failed")).body())
                continue
            ev = {"index": job.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                  "usage": c.usage.to_dict() if c.usage else None}
            if c.logprobs:
                ev["logprobs"] = _logprobs_json(c.logprobs)
            if c.prompt_logprobs is not None:
                ev["prompt_logprobs"] = _logprobs_json(c.prompt_logprobs)
            yield event(ev)
    yield DONE
