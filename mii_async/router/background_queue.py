"""BackgroundQueue: background requests wait in the router and reach a replica only through spare capacity.

A request of priority above 0 is background work (a batch's lines go at priority 1); priority 0 and below is
interactive and never waits here. A background request is encoded and admitted like any other (a bad one is
refused at once), then held in (priority, arrival) order. A replica takes the head of the queue only while:

- it has fewer background requests in flight than its bound (`max_background_per_replica`; by default
  default_bound's, lower on the CPU while interactive traffic is recent), so that most of each step's sequences
  stay free for interactive requests, and a burst of them is never queued in the engine behind batch lines
  already running there;
- no interactive request is being encoded in the router: it is about to be dispatched, and its prefill must not
  share its first step with the prefill of a batch line sent a moment before it;
- the request's cost (prompt + max_new_tokens) fits `max_queued_tokens` beside the dispatched requests', so
  that held work never makes the router refuse an interactive request as overloaded.

The core (core.py) owns one queue and asks it, at each event that can free capacity (a request finished,
failed or aborted, an interactive request encoded, a replica ready), for the next request to send. A held
request that ends (aborted, its client gone) leaves the queue at once. No sockets, no state of a replica's.
"""
from __future__ import annotations

import heapq
import time
from typing import NamedTuple

from ..config import SchedulerConfig
from ..errors import InvalidParameterError
from ..params import SamplingParams
from .replicas import Replica


class Held(NamedTuple):     # an encoded, admitted background request waiting for room
    priority: int           # SamplingParams.priority (> 0): lower first
    rid: int                # router request number: arrival order
    ids: list[int]          # the prompt's token ids
    cost: int               # prompt + max_new_tokens, counted once dispatched


def is_background(params: SamplingParams) -> bool:
    """Background work: what a caller ranked behind interactive requests (priority 0)."""
    return params.priority > 0


INTERACTIVE_RECENT_S = 30.0    # seconds: a chat user reads and types between requests


def default_bound(max_num_seqs: int, device_type: str, interactive: bool = False) -> int:
    """On a GPU, a quarter of a replica's running slots: a decode step reads the weights once for the whole
    batch, so its time hardly grows with the sequences in it, and background work fills the batch while three
    quarters of it stay free for interactive requests. At least 2, so that one background request can prefill
    while another decodes.
    On the CPU every running sequence lengthens every step, and an interactive request's first token waits for
    the step in progress: 2, and 1 while interactive traffic is recent (benchmarks/jobs_latency.py, SmolLM2-135M
    int4 on 2 cores: interactive TTFT p50 1.5x its idle figure with 2 lines in flight, 1.3x with 1, 2x with 8)."""
    if device_type == "cuda":
        return max(2, max_num_seqs // 4)
    return 1 if interactive else 2


class BackgroundQueue:
    def __init__(self, max_per_replica: int | None = None, scheduler: SchedulerConfig | None = None) -> None:
        """`max_per_replica`: background requests in flight on one replica at most; None: default_bound of
        the replica's device and max_num_seqs (as it reported it, else `scheduler`'s for that device)."""
        if max_per_replica is not None and (isinstance(max_per_replica, bool) or not isinstance(max_per_replica, int)
                                            or max_per_replica < 1):
            raise InvalidParameterError("max_background_per_replica",
                                        f"must be a positive integer or null, got {max_per_replica!r}")
        self.max_per_replica = max_per_replica
        self.scheduler = scheduler if scheduler is not None else SchedulerConfig()
        self._held: dict[int, Held] = {}                 # rid → held request: the truth
        self._heap: list[tuple[int, int]] = []           # (priority, rid), with entries of ended requests
        self._in_flight: dict[int, set[int]] = {}        # replica index → background rids dispatched there
        self._replica_of: dict[int, int] = {}            # background rid in flight → its replica index
        self._bounds: dict[tuple[int, int], int] = {}    # (replica index, generation) → its bound
        self.interactive_encoding: set[int] = set()      # rids of interactive requests not yet encoded
        self.last_interactive = float("-inf")            # time.monotonic() of the last interactive arrival
        self.peak: dict[int, int] = {}                   # replica index → most background requests in flight
        self.dispatched = 0                              # background requests sent to a replica, in all

    def __len__(self) -> int:
        """Held requests."""
        return len(self._held)

    # -- events of the core --------------------------------------------------------------------------
    def arrived(self, rid: int, params: SamplingParams) -> None:
        """A request was opened; an interactive one holds background work back until it is encoded."""
        if not is_background(params):
            self.interactive_encoding.add(rid)
            self.last_interactive = time.monotonic()

    def encoded(self, rid: int) -> None:
        """A request's prompt is encoded: it is dispatched (interactive) or held (background) right after."""
        self.interactive_encoding.discard(rid)

    def hold(self, rid: int, priority: int, ids: list[int], cost: int) -> None:
        assert priority > 0, f"request {rid} of priority {priority} is interactive: never held"
        assert rid not in self._held, f"request {rid} is already held"
        self._held[rid] = Held(priority, rid, ids, cost)
        heapq.heappush(self._heap, (priority, rid))

    def sent(self, rid: int, params: SamplingParams, replica: int) -> None:
        """A request was dispatched to `replica`: a background one counts against its bound until forgotten."""
        if not is_background(params):
            return
        flying = self._in_flight.setdefault(replica, set())
        flying.add(rid)
        self._replica_of[rid] = replica
        self.peak[replica] = max(self.peak.get(replica, 0), len(flying))
        self.dispatched += 1

    def forget(self, rid: int) -> None:
        """A request ended (finished, aborted, failed or refused): it leaves every count here."""
        self.interactive_encoding.discard(rid)
        if self._held.pop(rid, None) is not None and len(self._heap) > 2 * len(self._held) + 64:
            self._heap = [(h.priority, h.rid) for h in self._held.values()]    # drops ended requests' entries
            heapq.heapify(self._heap)
        replica = self._replica_of.pop(rid, None)
        if replica is not None:
            self._in_flight[replica].discard(rid)

    # -- dispatch ------------------------------------------------------------------------------------
    def take(self, ready: list[Replica], queued_tokens: int,
             max_queued_tokens: int) -> tuple[Held, list[Replica]] | None:
        """The held request to dispatch now, removed from the queue, with the `ready` replicas that have room
        for it; None while nothing may go (nothing held, an interactive request encoding, no replica with room,
        or the head's cost over `max_queued_tokens` beside the `queued_tokens` dispatched)."""
        if not self._held or self.interactive_encoding:
            return None
        room = [r for r in ready if len(self._in_flight.get(r.index, ())) < self.bound(r, self.interactive_recent())]
        if not room:
            return None
        while self._heap[0][1] not in self._held:        # an ended request's entry
            heapq.heappop(self._heap)
        head = self._held[self._heap[0][1]]
        if queued_tokens + head.cost > max_queued_tokens:
            return None
        heapq.heappop(self._heap)
        del self._held[head.rid]
        return head, room

    def held(self) -> list[Held]:
        """The held requests, in the order they will be dispatched."""
        return sorted(self._held.values())

    def interactive_recent(self) -> bool:
        """Whether an interactive request arrived within the last INTERACTIVE_RECENT_S."""
        return time.monotonic() - self.last_interactive < INTERACTIVE_RECENT_S

    def bound(self, rep: Replica, interactive: bool = False) -> int:
        """Background requests `rep` may have in flight (while interactive traffic is recent, where
        `interactive`). A bound that drops leaves the requests already in flight to finish."""
        if self.max_per_replica is not None:
            return self.max_per_replica
        key = (rep.index, rep.generation)
        if key not in self._bounds:
            info = rep.workers[0].info if 0 in rep.workers else {}
            device_type = "cuda" if str(info.get("device") or "cpu").startswith("cuda") else "cpu"
            seqs = info.get("max_num_seqs")
            if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1:
                seqs = self.scheduler.resolved(device_type).max_num_seqs
            self._bounds[key] = (default_bound(seqs, device_type), default_bound(seqs, device_type, True))
        return self._bounds[key][interactive]

    def stats(self, replicas: list[Replica]) -> dict:
        """Held and in-flight counts, and per replica (of `replicas`) its in-flight count, bound (as it stands
        now) and peak."""
        recent = self.interactive_recent()
        return {"held": len(self._held), "in_flight": len(self._replica_of), "dispatched": self.dispatched,
                "interactive_encoding": len(self.interactive_encoding), "interactive_recent": recent,
                "replicas": {str(r.index): {"in_flight": len(self._in_flight.get(r.index, ())),
                                            "bound": self.bound(r, recent),
                                            "peak": self.peak.get(r.index, 0)} for r in replicas}}
