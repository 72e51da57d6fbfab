"""Prometheus metrics of one gateway, in a registry of its own (so that several apps in one process, as in
tests, never collide). Request metrics are observed here as streams go by; deployment gauges (queue depth, KV
blocks, replicas) are read from the router when /metrics is scraped.

    mii_async_requests_total{api, status}           status: stop | length | abort | error | an error code
    mii_async_prompt_tokens_total{api} / mii_async_generation_tokens_total{api}
    mii_async_time_to_first_token_seconds{api} · mii_async_inter_token_latency_seconds{api}
    mii_async_e2e_request_latency_seconds{api}
    mii_async_requests_in_flight{api}               streams open in this gateway
    mii_async_queue_depth · mii_async_running_requests · mii_async_kv_blocks{state="used"|"free"|"cached"}
    mii_async_replica_up{replica, state}            1 for each replica in its current state
    mii_async_prefix_cache_query_tokens_total{replica} · mii_async_prefix_cache_hit_tokens_total{replica}
                                                    prompt tokens looked up in / served from the prefix cache
    mii_async_preemptions_total{replica} · mii_async_engine_steps_total{replica}
The last four are each ready replica's own counters as of the scrape (a restarted replica starts again at 0,
which Prometheus' rate() reads as a counter reset).
"""
from __future__ import annotations

import time
from typing import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily

from ..errors import error_code
from ..outputs import StreamChunk

disable_created_metrics()          # no *_created series: they double the scrape and nobody graphs them
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0)


class _EngineCounters:
    """Each replica's cumulative engine counters, as Prometheus counters, from the stats of the last scrape."""
    FAMILIES = (("mii_async_prefix_cache_query_tokens", "prefix_query_tokens",
                 "Prompt tokens looked up in the prefix cache"),
                ("mii_async_prefix_cache_hit_tokens", "prefix_hit_tokens", "Prompt tokens served from the prefix cache"),
                ("mii_async_preemptions", "preemptions", "Running sequences preempted for lack of KV blocks"),
                ("mii_async_engine_steps", "steps", "Engine steps run"))

    def __init__(self) -> None:
        self.stats: dict | None = None

    def collect(self):
        per = (self.stats or {}).get("replicas") or {}
        for name, key, doc in self.FAMILIES:
            fam = CounterMetricFamily(name, doc, labels=["replica"])
            for replica, s in sorted(per.items()):
                if isinstance(s.get(key), int):
                    fam.add_metric([str(replica)], s[key])
            yield fam


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.engine_counters = _EngineCounters()
        r.register(self.engine_counters)
        self.requests = Counter("mii_async_requests", "Finished or refused requests", ["api", "status"], registry=r)
        self.prompt_tokens = Counter("mii_async_prompt_tokens", "Prompt tokens of finished requests", ["api"],
                                     registry=r)
        self.generation_tokens = Counter("mii_async_generation_tokens", "Generated tokens streamed", ["api"],
                                         registry=r)
        self.ttft = Histogram("mii_async_time_to_first_token_seconds", "Request start to first token", ["api"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mii_async_inter_token_latency_seconds", "Time between streamed steps", ["api"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mii_async_e2e_request_latency_seconds", "Request start to its end", ["api"],
                             buckets=_E2E_BUCKETS, registry=r)
        self.in_flight = Gauge("mii_async_requests_in_flight", "Streams open in this gateway", ["api"], registry=r)
        self.queue_depth = Gauge("mii_async_queue_depth", "Requests waiting in the replicas' schedulers", registry=r)
        self.running = Gauge("mii_async_running_requests", "Requests running in the replicas", registry=r)
        self.router_live = Gauge("mii_async_router_live_requests", "Requests the router holds (all gateways)",
                                 registry=r)
        self.kv_blocks = Gauge("mii_async_kv_blocks", "KV cache blocks over ready replicas", ["state"], registry=r)
        self.replica_up = Gauge("mii_async_replica_up", "1 for each replica in its state", ["replica", "state"],
                                registry=r)

    def refused(self, path: str, code: str | None) -> None:
        """Counts a request refused before any stream opened (a bad parameter, a bad key is not counted)."""
        api = api_of(path)
        if api is not None:
            self.requests.labels(api, code or "error").inc()

    async def track(self, api: str, chunks: AsyncIterator[StreamChunk]) -> AsyncIterator[StreamChunk]:
        """Passes `chunks` through, observing TTFT, inter-token latency, end-to-end latency, tokens and the
        outcome. A stream left early (the client went away) counts as "abort"."""
        start = last = time.monotonic()
        first, status = True, "abort"
        self.in_flight.labels(api).inc()
        try:
            async for chunk in chunks:
                now = time.monotonic()
                if chunk.token_ids:
                    (self.ttft if first else self.itl).labels(api).observe(now - last)
                    first, last = False, now
                    self.generation_tokens.labels(api).inc(len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    status = chunk.finish_reason
                    if chunk.usage is not None:
                        self.prompt_tokens.labels(api).inc(chunk.usage.prompt_tokens)
                yield chunk
        except BaseException as exc:
            if isinstance(exc, Exception):       # not a cancellation: the request was refused or lost
                status = error_code(exc)
            raise
        finally:
            self.in_flight.labels(api).dec()
            self.requests.labels(api, status).inc()
            self.e2e.labels(api).observe(time.monotonic() - start)

    def observe_deployment(self, health: dict, stats: dict | None) -> None:
        """Sets the deployment gauges from the router's health and (fresh) stats."""
        self.router_live.set(health.get("live_requests", 0))
        self.replica_up.clear()
        for rep in health.get("replicas", []):
            self.replica_up.labels(str(rep.get("replica")), str(rep.get("state"))).set(1)
        if stats is not None:
            self.engine_counters.stats = stats
            self.queue_depth.set(stats.get("waiting", 0))
            self.running.set(stats.get("running", 0))
            for key, state in (("used_blocks", "used"), ("free_blocks", "free"), ("cached_blocks", "cached")):
                if key in stats:
                    self.kv_blocks.labels(state).set(stats[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)


def api_of(path: str) -> str | None:
    """The `api` label of a generation route's path; None for the others."""
    if path == "/v1/completions":
        return "completions"
    if path == "/v1/chat/completions":
        return "chat"
    if path == "/generate" or path.startswith("/mii/"):
        return "generate"
    return None


def metrics_content_type() -> str:
    from prometheus_client import CONTENT_TYPE_LATEST

    return CONTENT_TYPE_LATEST


