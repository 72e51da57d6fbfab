"""Supervision, the router's health loop: dead replicas, their replacements, silent clients.

Every HEALTH_PERIOD_S the loop checks the process sentinels and heartbeats of every replica (replicas.py).
A dead replica fails each of its in-flight requests with finish_reason "error" and a message naming the
replica and why, its processes are reaped, and — when it was started here and did not fail to load — a
replacement is started, after a backoff when it keeps dying. A client silent for `client_timeout_s` (it pings
while it has requests) loses its requests, so that a crashed client does not hold KV blocks.

The supervisor sees the router through `Supervised`: its replicas, their in-flight requests and failing them;
what that sends to clients and replicas leaves through `flush`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Protocol

from ..config import ServeConfig
from .replicas import Replica, ReplicaSet

log = logging.getLogger("mii_async.router")
HEALTH_PERIOD_S = 0.2
RESTART_BACKOFF_S = (0.0, 1.0, 5.0, 15.0, 30.0)   # before the n-th consecutive quick restart of a replica


class Supervised(Protocol):
    """What the supervisor needs of the router core (core.RouterCore is one)."""
    replicas: ReplicaSet     # each replica's processes, state and in-flight requests (`Replica.requests`)
    state: str               # the router's: replicas are replaced while it is "starting" or "ready"

    def fail_replica(self, rep: Replica, reason: str) -> None:
        """Ends each of the dead replica's in-flight requests with an error naming it and `reason`."""

    def expire_clients(self, now: float, timeout_s: float) -> None:
        """Aborts the requests of the clients not heard from for `timeout_s`."""


class Supervisor:
    def __init__(self, core: Supervised, serve: ServeConfig, flush: Callable[[], Awaitable[None]],
                 on_replica_gone: Callable[[int], None]) -> None:
        """`flush` writes out what the core has to send; `on_replica_gone(index)` is told of each death (the
        stats queries in flight stop waiting for it)."""
        self.core = core
        self.serve = serve
        self.flush = flush
        self.on_replica_gone = on_replica_gone
        self._restarts: dict[int, int] = {}

    async def run(self) -> None:
        """Checks health every HEALTH_PERIOD_S until cancelled; one failed check is logged, not fatal."""
        s = self.serve
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            try:
                now = time.monotonic()
                for rep, reason in self.core.replicas.find_dead(now, s.heartbeat_timeout_s, s.startup_timeout_s):
                    await self.replica_died(rep, reason)
                self.core.expire_clients(now, s.client_timeout_s)
            except Exception:  # noqa: BLE001 - the health loop must outlive any one failure
                log.exception("health check failed")
            await self.flush()

    async def replica_died(self, rep: Replica, reason: str) -> None:
        """Marks `rep` dead (once), fails its requests, reaps its processes and schedules its replacement."""
        if rep.state in ("dead", "stopping"):
            return
        was_ready = rep.state == "ready"
        self.core.replicas.mark_dead(rep, reason)
        self.on_replica_gone(rep.index)
        self.core.fail_replica(rep, reason)
        await self.flush()
        loop = asyncio.get_running_loop()
        for child in rep.children.values():
            loop.run_in_executor(None, child.stop, 5.0)           # reap the processes, off the loop
        if rep.local and not rep.load_failed and self.serve.restart_replicas and self._replacing():
            quick = was_ready and rep.ready_at is not None and time.monotonic() - rep.ready_at < 60
            n = self._restarts[rep.index] = self._restarts.get(rep.index, 0) + 1 if quick or not was_ready else 1
            delay = RESTART_BACKOFF_S[min(n - 1, len(RESTART_BACKOFF_S) - 1)]
            log.info("replica %d: starting a replacement in %.0f s", rep.index, delay)
            loop.call_later(delay, self._restart, rep.index)

    def _replacing(self) -> bool:
        return self.core.state in ("ready", "starting")

    def _restart(self, index: int) -> None:
        if self._replacing() and self.core.replicas.replicas[index].state == "dead":
            self.core.replicas.start_local(index)
