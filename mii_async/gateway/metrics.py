"""Prometheus metrics of one gateway, in a registry of its own (so that several apps in one process, as in
tests, never collide). Request metrics are observed here as streams go by; deployment gauges (queue depth, KV
blocks, replicas) are read from the router when /metrics is scraped.

    mii_async_requests_total{api, status}           status: stop | length | abort | error | an error code
    mii_async_prompt_tokens_total{api} / mii_async_generation_tokens_total{api}
    mii_async_time_to_first_token_seconds{api} · mii_async_inter_token_latency_seconds{api}
    mii_async_e2e_request_latency_seconds{api}
    mii_async_requests_in_flight{api}               streams open in this gateway
    mii_async_http_connections · mii_async_websockets   connections open in this gateway
    mii_async_connections_limited_total{limit}      connections refused or closed by a limit (its HttpConfig field)
    mii_async_queue_depth · mii_async_running_requests · mii_async_kv_blocks{state="used"|"free"|"cached"}
                                                    over ready replicas: only when every one answered
    mii_async_replica_kv_blocks{replica, state}     each replica that answered
    mii_async_replica_up{replica, state}            1 for each replica in its current state
    mii_async_replica_stats_up{replica}             1: its stats are in this scrape; 0: it did not answer
    mii_async_prefix_cache_query_tokens_total{replica} · mii_async_prefix_cache_hit_tokens_total{replica}
                                                    prompt tokens looked up in / served from the prefix cache
    mii_async_preemptions_total{replica} · mii_async_engine_steps_total{replica}
The last four are each ready replica's own counters as of the scrape (a restarted replica starts again at 0,
which Prometheus' rate() reads as a counter reset).

The Files and Batches API's, read from its store at each scrape (jobs/stats.py):
    mii_async_batches{status}                       batches stored, by OpenAI's status
    mii_async_batch_lines{state}                    queued | running | completed | failed
    mii_async_batch_lines_finished_total{outcome}   completed | failed: rate() is the batch line throughput
    mii_async_jobs_stored_bytes · mii_async_jobs_files · mii_async_jobs_max_stored_bytes
zeros where jobs_dir holds no store yet (the scrape creates none); absent where it holds one this gateway could
not open.

A replica busy in a long engine step may miss the router's stats deadline: its figures are then unknown, so
its samples are absent and its stats_up is 0 — never zeros, which would read as an exhausted KV pool; the
totals are absent too, since a partial sum would read as a smaller pool.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..errors import error_code
from ..outputs import StreamChunk

if TYPE_CHECKING:
    from ..jobs.stats import JobCounts

disable_created_metrics()          # no *_created series: they double the scrape and nobody graphs them
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0)


class _DeploymentStats:
    """The replicas' engine figures from the stats of the last scrape, as collected families: only those of
    replicas that answered, so that an unanswered replica's are absent rather than stale or zero."""
    COUNTERS = (("mii_async_prefix_cache_query_tokens", "prefix_query_tokens",
                 "Prompt tokens looked up in the prefix cache"),
                ("mii_async_prefix_cache_hit_tokens", "prefix_hit_tokens", "Prompt tokens served from the prefix cache"),
                ("mii_async_preemptions", "preemptions", "Running sequences preempted for lack of KV blocks"),
                ("mii_async_engine_steps", "steps", "Engine steps run"))
    TOTALS = (("mii_async_queue_depth", "waiting", "Requests waiting in the replicas' schedulers"),
              ("mii_async_running_requests", "running", "Requests running in the replicas"))
    KV_STATES = (("used_blocks", "used"), ("free_blocks", "free"), ("cached_blocks", "cached"))

    def __init__(self) -> None:
        self.ready: list[str] = []          # the replicas health() calls ready: those asked for stats
        self.stats: dict | None = None      # the router's stats() answer; None when it gave none

    def collect(self):
        stats = self.stats or {}
        per = {str(k): v for k, v in (stats.get("replicas") or {}).items() if isinstance(v, dict)}
        unanswered = {str(r) for r in stats.get("unanswered") or []}
        asked = sorted(set(self.ready) | set(per) | unanswered, key=_replica_order)
        answered = [r for r in asked if r in per]
        # totals only from a full answer: with no replica, or one missing, they would read as a pool of 0 blocks
        complete = bool(answered) and len(answered) == len(asked)
        up = GaugeMetricFamily("mii_async_replica_stats_up", "1: the replica's stats are in this scrape; 0: it did "
                               "not answer in time (its samples are absent)", labels=["replica"])
        for replica in asked:
            up.add_metric([replica], 1 if replica in per else 0)
        yield up
        kv = GaugeMetricFamily("mii_async_kv_blocks", "KV cache blocks over ready replicas (absent unless every "
                               "one answered)", labels=["state"])
        own = GaugeMetricFamily("mii_async_replica_kv_blocks", "KV cache blocks of a replica that answered",
                                labels=["replica", "state"])
        for key, state in self.KV_STATES:
            if complete and isinstance(stats.get(key), int):
                kv.add_metric([state], stats[key])
            for replica in answered:
                if isinstance(per[replica].get(key), int):
                    own.add_metric([replica, state], per[replica][key])
        yield kv
        yield own
        for name, key, doc in self.TOTALS:
            fam = GaugeMetricFamily(name, doc + " (absent unless every ready replica answered)")
            if complete and isinstance(stats.get(key), int):
                fam.add_metric([], stats[key])
            yield fam
        for name, key, doc in self.COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["replica"])
            for replica in answered:
                if isinstance(per[replica].get(key), int):
                    fam.add_metric([replica], per[replica][key])
            yield fam


class _JobMetrics:
    """The Files and Batches API's figures, from `source` at each scrape (None, or a source that gives None:
    the families are present without samples)."""

    def __init__(self) -> None:
        self.source: Callable[[], JobCounts | None] | None = None

    def collect(self):
        counts = self.source() if self.source is not None else None
        batches = GaugeMetricFamily("mii_async_batches", "Batches stored, by status", labels=["status"])
        lines = GaugeMetricFamily("mii_async_batch_lines", "Lines of the stored batches: queued, running (in "
                                  "flight here), completed (2xx), failed", labels=["state"])
        finished = CounterMetricFamily("mii_async_batch_lines_finished", "Batch lines answered since the gateway "
                                       "started, by outcome (completed: 2xx)", labels=["outcome"])
        stored = GaugeMetricFamily("mii_async_jobs_stored_bytes", "Bytes of every stored file (uploads and "
                                   "batch results)")
        files = GaugeMetricFamily("mii_async_jobs_files", "Files stored")
        limit = GaugeMetricFamily("mii_async_jobs_max_stored_bytes", "The bound on stored bytes (an upload past "
                                  "it is refused)")
        if counts is not None:
            for status, n in counts.batches.items():
                batches.add_metric([status], n)
            for state, n in counts.lines.items():
                lines.add_metric([state], n)
            for outcome, n in counts.finished.items():
                finished.add_metric([outcome], n)
            stored.add_metric([], counts.stored_bytes)
            files.add_metric([], counts.files)
            limit.add_metric([], counts.max_stored_bytes)
        yield from (batches, lines, finished, stored, files, limit)


def _replica_order(replica: str) -> tuple[int, str]:
    return (int(replica), "") if replica.isdigit() else (1 << 30, replica)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.deployment = _DeploymentStats()
        r.register(self.deployment)
        self.jobs = _JobMetrics()             # its source is set where the jobs store is (gateway/app.py)
        r.register(self.jobs)
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
        self.router_live = Gauge("mii_async_router_live_requests", "Requests the router holds (all gateways)",
                                 registry=r)
        self.replica_up = Gauge("mii_async_replica_up", "1 for each replica in its state", ["replica", "state"],
                                registry=r)
        # Read from the connection bounds' counts (connection_limits.py, ws_limits.py) at each scrape.
        self.http_connections = Gauge("mii_async_http_connections", "HTTP connections open (an upgraded "
                                      "WebSocket counts in mii_async_websockets)", registry=r)
        self.websockets = Gauge("mii_async_websockets", "WebSocket connections open", registry=r)
        self.connections_limited = Counter("mii_async_connections_limited", "Connections refused or closed by a "
                                           "limit, by the limit's HttpConfig field", ["limit"], registry=r)

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
        """Sets the deployment gauges from the router's health and fresh stats (None: the router gave none, so
        every ready replica's figures are unknown)."""
        self.router_live.set(health.get("live_requests", 0))
        self.replica_up.clear()
        for rep in health.get("replicas", []):
            self.replica_up.labels(str(rep.get("replica")), str(rep.get("state"))).set(1)
        self.deployment.ready = [str(rep.get("replica")) for rep in health.get("replicas", [])
                                 if rep.get("state") == "ready"]
        self.deployment.stats = stats

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


