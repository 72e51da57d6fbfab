"""WorkerLink: the router's loop on the workers' socket — handshakes, heartbeats, and each step's tokens.

Hello is answered with Assign (or Shutdown for a worker that has no place: a stray of a dead generation, a
mismatched routing id, a router that is stopping); Ready completes a replica; LoadFailed ends it (for good
when a restart cannot help). Heartbeats are echoed only to registered workers, and an unknown one is told to
stop. StepTokens and RequestFailed go to the router core (core.py), which turns them into Deltas; a leader's
StatsReport to the stats queries. After each message, what the core has to send leaves through `flush`.

Only workers hold the key this socket admits (mesh_keys.py), and still every message is checked as a client's
is: a frame that does not decode, a StepTokens whose lists disagree, counters that are not numbers, a Ready
without its limits — each is counted (`bad_worker_messages`) and fails that worker's replica (its requests end
with an error, the supervisor restarts it); the router and the other replicas carry on.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable, NamedTuple

from .. import protocol as P
from ..request_limits import RequestLimits
from ..transport import RouterSocket
from .core import RouterCore
from .replicas import Replica
from .stats_queries import StatsQueries
from .token_events import well_formed

log = logging.getLogger("mii_async.router")
# Load failures that a restart cannot fix (others, such as an out-of-memory while an old process's memory is
# still being freed, get the supervisor's restart with backoff).
PERMANENT_LOAD_ERRORS = ("invalid_parameter", "request_too_long", "model_not_found", "unsupported_model")


def counters_well_formed(stats: dict) -> bool:
    """Engine counters as /metrics and stats() read them: names mapped to numbers."""
    return all(isinstance(k, str) and type(v) in (int, float) for k, v in stats.items())


class Assignment(NamedTuple):    # what every Assign carries beside the worker's place
    engine: dict                 # EngineConfig.to_dict()
    heartbeat_s: float           # the workers' heartbeat period
    heartbeat_timeout_s: float   # a worker stops when the router has not answered this long


class WorkerLink:
    def __init__(self, sock: RouterSocket, core: RouterCore, assignment: Assignment, stats_queries: StatsQueries,
                 flush: Callable[[], Awaitable[None]],
                 on_load_failed: Callable[[Replica, str], Awaitable[None]]) -> None:
        """`flush` writes out what the core has to send; `on_load_failed(replica, reason)` ends a replica that
        could not load the model (the supervisor's `replica_died`)."""
        self.sock = sock
        self.core = core
        self.replicas = core.replicas
        self.assignment = assignment
        self.stats_queries = stats_queries
        self.flush = flush
        self.on_load_failed = on_load_failed
        self.load_errors: list[tuple[str, str]] = []    # (code, message) of the replicas that failed to load

    async def run(self) -> None:
        """Reads the workers' socket until cancelled; one message's failure is logged, never stops the loop."""
        while True:
            peer, msg, _ = await self.sock.recv()
            try:
                await self._on_message(peer, msg)
            except Exception:  # noqa: BLE001
                log.exception("error handling a worker message")
            await self.flush()

    async def _on_message(self, peer: bytes, msg: Any) -> None:
        if isinstance(msg, P.StepTokens):
            if not well_formed(msg):
                await self._malformed(peer, "a StepTokens whose lists disagree in length")
                return
            self.core.step_tokens(peer, msg)
        elif isinstance(msg, P.Heartbeat):
            found = self.replicas.worker(peer.decode(errors="replace").removesuffix("/hb"))
            if found is None:                         # not (or no longer) one of ours: it should stop
                await self.sock.send(peer, P.Shutdown())
                return
            if not counters_well_formed(msg.stats):
                await self._malformed(peer, "a Heartbeat whose counters are not numbers")
                return
            found[0].last_heartbeat = time.monotonic()
            if found[1] == 0:
                found[0].stats = msg.stats
            await self.sock.send(peer, P.Heartbeat(replica=-1, stats={}))
        elif isinstance(msg, P.RequestFailed):
            self.core.request_failed(peer, msg)
        elif isinstance(msg, P.StatsReport):
            rep = self.replicas.replicas.get(msg.replica) if isinstance(msg.replica, int) else None
            if rep is not None and rep.leader == peer and not counters_well_formed(msg.stats):
                await self._malformed(peer, "a StatsReport whose counters are not numbers")
            elif rep is not None and rep.leader == peer:
                self.stats_queries.on_report(msg)          # only the replica's leader answers for it
            else:
                log.debug("a stats report for replica %r from %r, which is not its leader: ignored", msg.replica, peer)
        elif isinstance(msg, P.Hello):
            await self._on_hello(peer, msg)
        elif isinstance(msg, P.Ready):
            if self.replicas.worker(peer.decode(errors="replace")) is None:
                await self.sock.send(peer, P.Shutdown())   # e.g. its replica timed out while loading
                return
            found = self.replicas.worker(peer.decode(errors="replace"))
            if found[1] == 0:                              # the leader's limits admit every request
                try:
                    RequestLimits.from_dict(msg.info)
                except ValueError as exc:
                    await self._malformed(peer, f"a Ready whose limits are malformed ({exc})")
                    return
            rep = self.replicas.on_ready(peer.decode(errors="replace"), msg.info)
            if rep is not None:
                self.core.replica_ready(rep)
                log.info("replica %d ready (%s)", rep.index, rep.workers[0].info.get("device"))
        elif isinstance(msg, P.LoadFailed):
            found = self.replicas.worker(peer.decode(errors="replace"))
            if found is not None:
                found[0].load_failed = msg.code in PERMANENT_LOAD_ERRORS
                self.load_errors.append((msg.code, msg.message))
                await self.on_load_failed(found[0], f"could not load the model: {msg.message}")
        elif isinstance(msg, P.ProtocolError):
            await self._malformed(peer, f"a frame that does not decode ({msg})")
        else:
            await self._malformed(peer, f"a {type(msg).__name__}, which workers do not send")

    async def _malformed(self, peer: bytes, what: str) -> None:
        """Counts a malformed message and fails the replica of the worker that sent it."""
        self.core.counters["bad_worker_messages"] += 1
        found = self.replicas.worker(peer.decode(errors="replace").removesuffix("/hb"))
        log.warning("worker %r sent %s: %s", peer, what,
                    f"failing replica {found[0].index}" if found is not None else "it holds no place; dropped")
        await self.sock.send(peer, P.Shutdown())
        if found is not None:
            await self.on_load_failed(found[0], f"its worker sent {what}")

    async def _on_hello(self, peer: bytes, msg: P.Hello) -> None:
        rep = None
        if msg.worker.encode() == peer and self.core.state in ("starting", "ready"):
            rep = self.replicas.on_hello(msg.worker, msg.replica, msg.rank, msg.pid, msg.host)
        if rep is None:
            log.warning("refusing worker %s (replica %d rank %d)", msg.worker, msg.replica, msg.rank)
            await self.sock.send(peer, P.Shutdown())
            return
        a = self.assignment
        await self.sock.send(peer, P.Assign(replica=rep.index, rank=msg.rank, tensor_parallel=rep.tensor_parallel,
                                            device_index=rep.index * rep.tensor_parallel + msg.rank,
                                            config=a.engine, heartbeat_s=a.heartbeat_s,
                                            heartbeat_timeout_s=a.heartbeat_timeout_s, dist_init=rep.dist_init))
