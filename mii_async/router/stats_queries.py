"""The router's fresh-stats queries: a StatsQuery to every ready replica leader, gathered by token, with a
deadline. Each leader answers after every message sent to it before, so the figures already show an abort
sent just before. A replica that dies meanwhile is no longer waited for; one that is silent past the deadline
is reported as `unanswered`."""
from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING

from .. import protocol as P

if TYPE_CHECKING:
    from .replicas import ReplicaSet
    from ..transport import RouterSocket

STATS_TIMEOUT_S = 4.0     # under the gateway's 5 s for a /metrics scrape, so a silent replica leaves the others'
RESET_TIMEOUT_S = 10.0    # a reset is worth the wait: a benchmark's next run depends on it


class StatsQueries:
    def __init__(self, replicas: ReplicaSet, workers_sock: RouterSocket) -> None:
        self.replicas, self.workers_sock = replicas, workers_sock
        self._tokens = itertools.count()
        self._waiters: dict[int, tuple[asyncio.Future, set[int], dict[int, dict]]] = {}  # token → (fut, want, got)

    async def gather(self, reset_prefix_cache: bool = False) -> dict:
        """Fresh engine counters from every ready replica, summed, and per replica under `replicas`; with
        `reset_prefix_cache`, each first forgets the prefixes of its free blocks. `unanswered` lists the
        replicas asked that did not answer in time (STATS_TIMEOUT_S, RESET_TIMEOUT_S) and did not die
        meanwhile. Every key of P.ENGINE_COUNTERS is in the totals, summed over the replicas that answered."""
        token = next(self._tokens)
        ready = [r for r in self.replicas.ready() if r.leader is not None]
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters[token] = (fut, {r.index for r in ready}, {})
        for rep in ready:
            await self.workers_sock.send(rep.leader, P.StatsQuery(token=token, reset_prefix_cache=reset_prefix_cache))
        try:
            timeout = RESET_TIMEOUT_S if reset_prefix_cache else STATS_TIMEOUT_S
            per = await asyncio.wait_for(fut, timeout) if ready else {}
        except asyncio.TimeoutError:
            per = self._waiters[token][2]
        finally:
            want = self._waiters.pop(token, (None, set(), {}))[1]     # less the replicas that died
        totals = dict.fromkeys(P.ENGINE_COUNTERS, 0)
        if reset_prefix_cache:
            totals["prefix_blocks_forgotten"] = 0
        for s in per.values():
            for k, v in s.items():
                if isinstance(v, int):
                    totals[k] = totals.get(k, 0) + v
        return {**totals, "replicas": {str(i): s for i, s in sorted(per.items())},
                "unanswered": sorted(want - set(per))}

    def on_report(self, msg: P.StatsReport) -> None:
        waiter = self._waiters.get(msg.token)
        if waiter is not None:
            fut, want, got = waiter
            got[msg.replica] = msg.stats
            if want <= set(got) and not fut.done():
                fut.set_result(got)

    def replica_gone(self, index: int) -> None:
        """A replica died: the queries in flight stop waiting for it."""
        for fut, want, got in self._waiters.values():
            want.discard(index)
            if want <= set(got) and not fut.done():
                fut.set_result(got)
