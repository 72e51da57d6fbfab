"""Supervision, the router's health loop: dead replicas, their replacements, silent clients.

Every HEALTH_PERIOD_S the loop checks the process sentinels and heartbeats of every replica (replicas.py).
A dead replica fails each of its in-flight requests with finish_reason "error" and a message naming the
replica and why, its processes are reaped, and — when it was started here and did not fail to load — a
replacement is started, after a backoff when it keeps dying. A client silent for `client_timeout_s` (it pings
while it has requests) loses its requests, so that a crashed client does not hold KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from .replicas import Replica
from ..text.request_state import Ended

if TYPE_CHECKING:
    from .server import Router

log = logging.getLogger("mii_async.router")
HEALTH_PERIOD_S = 0.2
RESTART_BACKOFF_S = (0.0, 1.0, 5.0, 15.0, 30.0)   # before the n-th consecutive quick restart of a replica


class Supervisor:
    def __init__(self, router: Router) -> None:
        self.router = router
        self._restarts: dict[int, int] = {}

    async def run(self) -> None:
        s = self.router.serve_cfg
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            try:
                now = time.monotonic()
                for rep, reason in self.router.replicas.find_dead(now, s.heartbeat_timeout_s, s.startup_timeout_s):
                    await self.replica_died(rep, reason)
                await self._expire_clients(now)
            except Exception:  # noqa: BLE001 - the health loop must outlive any one failure
                log.exception("health check failed")

    async def replica_died(self, rep: Replica, reason: str) -> None:
        if rep.state in ("dead", "stopping"):
            return
        was_ready = rep.state == "ready"
        self.router.counters["replica_deaths"] += 1
        log.error("replica %d died: %s; failing its %d request(s)", rep.index, reason, len(rep.requests))
        self.router.replicas.mark_dead(rep, reason)
        self.router.stats_queries.replica_gone(rep.index)
        for rid in list(rep.requests):
            live = self.router.live.get(rid)
            if live is not None:
                self.router.counters["failed"] += 1
                await self.router.end(live, Ended("error", f"replica {rep.index} failed: {reason}"), tell_replica=False)
        loop = asyncio.get_running_loop()
        for child in rep.children.values():
            loop.run_in_executor(None, child.stop, 5.0)           # reap the processes, off the loop
        if rep.local and not rep.load_failed and self.router.serve_cfg.restart_replicas and self.router.state in ("ready", "starting"):
            quick = was_ready and rep.ready_at is not None and time.monotonic() - rep.ready_at < 60
            n = self._restarts[rep.index] = self._restarts.get(rep.index, 0) + 1 if quick or not was_ready else 1
            delay = RESTART_BACKOFF_S[min(n - 1, len(RESTART_BACKOFF_S) - 1)]
            log.info("replica %d: starting a replacement in %.0f s", rep.index, delay)
            loop.call_later(delay, self._restart, rep.index)

    def _restart(self, index: int) -> None:
        if self.router.state in ("ready", "starting") and self.router.replicas.replicas[index].state == "dead":
            self.router.replicas.start_local(index)

    async def _expire_clients(self, now: float) -> None:
        timeout = self.router.serve_cfg.client_timeout_s
        gone = {p for p, seen in self.router.client_seen.items() if now - seen > timeout}
        if not gone:
            return
        for live in [x for x in self.router.live.values() if x.peer in gone]:
            log.warning("client %r silent for %.0f s: aborting its request %s", live.peer, timeout, live.creq)
            await self.router.end(live, Ended("abort", "client timed out"), tell_replica=True)
        for p in gone:
            del self.router.client_seen[p]
