"""Replicas as the router sees them: their worker processes, handshake state, health and load.

A replica is `tensor_parallel` workers; rank 0 leads and is the only one the router sends requests to.
States: starting (spawned, not every rank ready) → ready → dead (a worker exited, stopped heart-beating or
failed to load) or stopping (shutdown). Local replicas are started here as child processes with a lifeline;
a replica of workers that joined from another host (`mii-async worker --router …`) has no child processes and
is watched through heartbeats only. Each start of a replica number is a new generation, so a late message from
a dead generation is recognised and ignored.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field

from ..lifecycle import Child
from ..request_limits import RequestLimits

log = logging.getLogger("mii_async.router")


@dataclass
class WorkerInfo:
    name: str                      # the worker's unique name, also its routing id on the workers' socket
    rank: int
    pid: int
    host: str
    ready: bool = False
    info: dict = field(default_factory=dict)     # what Ready reported (limits, KV blocks, device, …)


@dataclass
class Replica:
    index: int
    generation: int
    tensor_parallel: int
    local: bool                    # started by this router (it has child processes to watch)
    state: str = "starting"        # starting | ready | dead | stopping
    children: dict[int, Child] = field(default_factory=dict)       # rank → process (local replicas)
    workers: dict[int, WorkerInfo] = field(default_factory=dict)   # rank → worker that said hello
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    last_heartbeat: float = field(default_factory=time.monotonic)
    requests: set[int] = field(default_factory=set)                # router request numbers in flight here
    stats: dict = field(default_factory=dict)                       # the leader's counters, from heartbeats
    error: str | None = None       # why it died
    load_failed: bool = False      # it could not load the model: never restarted
    dist_init: str = ""            # where its tensor-parallel ranks rendezvous (torch.distributed)

    @property
    def leader(self) -> bytes | None:
        w = self.workers.get(0)
        return w.name.encode() if w is not None else None

    @property
    def limits(self) -> RequestLimits | None:
        w = self.workers.get(0)
        return RequestLimits.from_dict(w.info) if w is not None and w.ready else None

    def describe(self, load_tokens: int) -> dict:
        return {"replica": self.index, "generation": self.generation, "state": self.state, "local": self.local,
                "pids": [w.pid for w in self.workers.values()] or [c.pid for c in self.children.values()],
                "hosts": sorted({w.host for w in self.workers.values()}), "requests": len(self.requests),
                "load_tokens": load_tokens, "error": self.error,
                "device": self.workers[0].info.get("device") if 0 in self.workers else None,
                "peak_rss_mib": [w.info.get("peak_rss_mib") for _, w in sorted(self.workers.items())],
                "engine": self.stats}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReplicaSet:
    def __init__(self, tensor_parallel: int, worker_address: str, curve_dir: str | None) -> None:
        self.tensor_parallel = tensor_parallel
        self.worker_address = worker_address
        self.curve_dir = curve_dir
        self.replicas: dict[int, Replica] = {}
        self._by_worker: dict[str, tuple[Replica, int]] = {}   # worker name → (replica, rank)
        self._generations: dict[int, int] = {}

    # -- starting ------------------------------------------------------------------------------------
    def start_local(self, index: int) -> Replica:
        gen = self._generations[index] = self._generations.get(index, -1) + 1
        rep = Replica(index, gen, self.tensor_parallel, local=True)
        if self.tensor_parallel > 1:
            rep.dist_init = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(self.tensor_parallel):
            argv = [sys.executable, "-m", "mii_async.workers.main", "--router", self.worker_address,
                    "--replica", str(index), "--rank", str(rank)]
            if self.curve_dir:
                argv += ["--curve-dir", self.curve_dir]
            rep.children[rank] = Child(argv, f"replica {index} rank {rank}")
        self.replicas[index] = rep
        log.info("replica %d (generation %d): started pids %s", index, gen, [c.pid for c in rep.children.values()])
        return rep

    def on_hello(self, name: str, replica: int, rank: int, pid: int, host: str) -> Replica | None:
        """Places a worker that said hello; None when it has no place (the caller tells it to shut down)."""
        if replica < 0:                       # a worker that joins: a new remote replica (TP=1 joins only)
            if rank != 0 or self.tensor_parallel != 1:
                return None
            replica = max(self.replicas, default=-1) + 1
            gen = self._generations[replica] = self._generations.get(replica, -1) + 1
            self.replicas[replica] = Replica(replica, gen, 1, local=False)
        rep = self.replicas.get(replica)
        if rep is None or rep.state != "starting" or rank in rep.workers or not 0 <= rank < rep.tensor_parallel:
            return None
        if rep.local and not any(c.pid == pid for c in rep.children.values()):
            return None                       # a stray process of an older generation
        rep.workers[rank] = WorkerInfo(name, rank, pid, host)
        self._by_worker[name] = (rep, rank)
        return rep

    def on_ready(self, name: str, info: dict) -> Replica | None:
        """Marks a worker ready; returns its replica when that made the whole replica ready."""
        found = self._by_worker.get(name)
        if found is None:
            return None
        rep, rank = found
        w = rep.workers[rank]
        w.ready, w.info = True, info
        if rep.state == "starting" and len(rep.workers) == rep.tensor_parallel and all(x.ready for x in rep.workers.values()):
            rep.state, rep.ready_at, rep.last_heartbeat = "ready", time.monotonic(), time.monotonic()
            return rep
        return None

    def worker(self, name: str) -> tuple[Replica, int] | None:
        return self._by_worker.get(name)

    # -- health --------------------------------------------------------------------------------------
    def find_dead(self, now: float, heartbeat_timeout_s: float, startup_timeout_s: float) -> list[tuple[Replica, str]]:
        """Replicas that just died, with why: a child exited, heartbeats stopped, or startup took too long."""
        dead = []
        for rep in self.replicas.values():
            if rep.state not in ("starting", "ready"):
                continue
            reason = next((c.describe_exit() for c in rep.children.values() if c.poll() is not None), None)
            if reason is None and rep.state == "ready" and now - rep.last_heartbeat > heartbeat_timeout_s:
                reason = f"no heartbeat for {now - rep.last_heartbeat:.1f} s"
            if reason is None and rep.state == "starting" and now - rep.started_at > startup_timeout_s:
                reason = f"not ready after {startup_timeout_s:.0f} s"
            if reason is not None:
                dead.append((rep, reason))
        return dead

    def mark_dead(self, rep: Replica, reason: str) -> None:
        rep.state, rep.error = "dead", reason
        for w in rep.workers.values():
            self._by_worker.pop(w.name, None)
        for child in rep.children.values():
            child.cut_lifeline()              # the other ranks exit on their own; reaped by stop()

    def ready(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state == "ready"]

    def limits(self) -> RequestLimits | None:
        out = None
        for rep in self.ready():
            lim = rep.limits
            if lim is not None:
                out = lim if out is None else out.merge(lim)
        return out

    def all_children(self) -> list[Child]:
        return [c for r in self.replicas.values() for c in r.children.values()]
