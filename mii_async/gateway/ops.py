"""Operations: GET (or HEAD) /health (200 when the deployment can take requests, else 503), GET /metrics, and
POST /reset_prefix_cache (every replica forgets the prefixes of its free KV blocks: benchmarks' reruns)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..errors import MIIAsyncError
from .http_errors import HTTPError
from .metrics import metrics_content_type
from .state import GatewayState
from .text_route import CheckedRoute

router = APIRouter(route_class=CheckedRoute)


@router.api_route("/health", methods=["GET", "HEAD"])      # HEAD: some load balancers' checks use it
async def health(request: Request) -> JSONResponse:
    """200 {"status": "ready", …} when the router is ready with a live replica; 503 while it starts or
    drains, when no replica is alive, or when the router does not answer."""
    s: GatewayState = request.app.state.gateway
    h = await s.health()
    replicas = h.get("replicas", [])
    ready = h.get("state") == "ready" and any(r.get("state") == "ready" for r in replicas)
    body = {"status": "ready" if ready else h.get("state", "unavailable"), "model": s.model_name,
            "replicas": {str(r.get("replica")): r.get("state") for r in replicas},
            "live_requests": h.get("live_requests", 0)}
    if "error" in h:
        body["error"] = h["error"]
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    s: GatewayState = request.app.state.gateway
    h = await s.health()
    stats = None
    if h.get("state") in ("ready", "draining"):
        try:
            stats = await asyncio.wait_for(s.client.stats(), 5.0)
        except Exception:  # noqa: BLE001 - the scrape still gets the gateway's own metrics
            stats = None
    s.metrics.observe_deployment(h, stats)
    return Response(s.metrics.render(), media_type=metrics_content_type())


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> JSONResponse:
    """200 {"prefix_blocks_forgotten": N, "replicas": {...}}: each ready replica forgot the prefixes of the
    KV blocks no request holds (as vLLM's /reset_prefix_cache and SGLang's /flush_cache); 503 when the router
    or one of its replicas does not answer."""
    s: GatewayState = request.app.state.gateway
    try:
        r = await asyncio.wait_for(s.client.reset_prefix_cache(), 30.0)
    except (asyncio.TimeoutError, MIIAsyncError) as exc:    # the router, or one of its replicas, is silent
        msg = str(exc) if isinstance(exc, MIIAsyncError) else "the router did not answer within 30 s"
        raise HTTPError(503, msg, "service_unavailable_error", code="unavailable") from None
    per = {k: v.get("prefix_blocks_forgotten", 0) for k, v in r.get("replicas", {}).items()}
    return JSONResponse({"prefix_blocks_forgotten": r.get("prefix_blocks_forgotten", 0), "replicas": per})
