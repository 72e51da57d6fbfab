"""The router's request table: every live request, by router number and by its client's id, and what the
admitted ones cost their replicas.

A request is live from its Generate until it finishes, is aborted or fails; while its prompt is being encoded it
has no state and no replica yet. `queued_tokens` sums the costs (prompt + max_new_tokens) of the dispatched
requests, the figure `max_queued_tokens` bounds. No sockets: the core (core.py) owns one table.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

from ..params import SamplingParams
from ..text.request_state import RequestState
from .replicas import Replica


@dataclass
class LiveRequest:
    rid: int                          # router-wide request number (the workers' req_id)
    peer: bytes                       # the client's routing id
    creq: str                         # the client's req_id
    params: SamplingParams            # checked when the Generate came
    state: RequestState | None = None  # None while its prompt is encoded
    replica: Replica | None = None    # set when dispatched, with state
    cost: int = 0                     # prompt + max_new_tokens, counted against max_queued_tokens


class RequestTable:
    def __init__(self) -> None:
        self._live: dict[int, LiveRequest] = {}
        self._by_client: dict[tuple[bytes, str], int] = {}
        self._rids = itertools.count()
        self.queued_tokens = 0

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[LiveRequest]:
        """The live requests, oldest first; a snapshot, so that ending them while iterating is safe."""
        return iter(list(self._live.values()))

    def open(self, peer: bytes, creq: str, params: SamplingParams) -> LiveRequest:
        assert (peer, creq) not in self._by_client, f"request {creq!r} of {peer!r} is already live"
        live = LiveRequest(next(self._rids), peer, creq, params)
        self._live[live.rid] = live
        self._by_client[(peer, creq)] = live.rid
        return live

    def get(self, rid: int) -> LiveRequest | None:
        return self._live.get(rid)

    def find(self, peer: bytes, creq: str) -> LiveRequest | None:
        """The live request a client knows as `creq`."""
        rid = self._by_client.get((peer, creq))
        return None if rid is None else self._live[rid]

    def of_client(self, peer: bytes) -> list[str]:
        """The client's ids of its live requests (a ping's answer: one it does not list was lost)."""
        return [creq for (p, creq) in self._by_client if p == peer]

    def dispatch(self, live: LiveRequest, state: RequestState, replica: Replica, cost: int) -> None:
        """An encoded, admitted request goes to `replica`: its cost counts until it is forgotten."""
        live.state, live.replica, live.cost = state, replica, cost
        replica.requests.add(live.rid)
        self.queued_tokens += cost

    def forget(self, live: LiveRequest) -> bool:
        """Drops a request (finished, aborted or failed); False when it was already gone."""
        if self._live.get(live.rid) is not live:
            return False
        del self._live[live.rid]
        self._by_client.pop((live.peer, live.creq), None)
        if live.replica is not None:
            live.replica.requests.discard(live.rid)
            self.queued_tokens -= live.cost
        return True

    def load(self, replica: Replica) -> int:
        """Outstanding tokens: what the replica's live requests may still cost it (prompt + max_new_tokens,
        less what they generated)."""
        total = 0
        for rid in replica.requests:
            live = self._live.get(rid)
            if live is not None and live.state is not None:
                total += live.cost - len(live.state.output_ids)
        return total
