"""Balancer: which replica takes a request — the least outstanding work, with prefix affinity.

Load is a replica's outstanding tokens: for each of its live requests, prompt plus max_new_tokens minus what it
has generated so far. Blind round-robin ignores that one long request can weigh as much as a hundred short
ones. Among the replicas whose load is close to the least (within `slack` of it, or `min_slack_tokens`), the
one that most recently received the longest block-aligned prefix of this prompt wins: its prefix cache
probably still holds those blocks, so the prompt costs it less to prefill. Affinity memory is a bounded LRU
of chained block hashes per replica, approximate by design (the engine's own cache is the truth).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, NamedTuple


class Candidate(NamedTuple):
    index: int          # replica number
    load: int           # outstanding tokens


class Balancer:
    def __init__(self, block_size: int = 16, *, slack: float = 0.25, min_slack_tokens: int = 256,
                 max_prefix_blocks: int = 64, memory: int = 8192) -> None:
        self.block_size = block_size
        self.slack, self.min_slack_tokens = slack, min_slack_tokens
        self.max_prefix_blocks = max_prefix_blocks
        self.memory = memory
        self._seen: dict[int, OrderedDict[int, None]] = {}   # replica → recent prefix hashes (LRU)

    def prefix_hashes(self, prompt_ids: list[int]) -> list[int]:
        """Chained hashes of the prompt's full blocks: hashes[k] covers blocks 0..k."""
        out, h, bs = [], 0, self.block_size
        for k in range(min(len(prompt_ids) // bs, self.max_prefix_blocks)):
            h = hash((h, tuple(prompt_ids[k * bs:(k + 1) * bs])))
            out.append(h)
        return out

    def matched_blocks(self, index: int, hashes: list[int]) -> int:
        seen = self._seen.get(index)
        if not seen:
            return 0
        for k in range(len(hashes) - 1, -1, -1):
            if hashes[k] in seen:
                return k + 1
        return 0

    def pick(self, candidates: Iterable[Candidate], prompt_ids: list[int]) -> int | None:
        """The chosen replica's index (None when there is no candidate); remembers the prompt's prefix there."""
        cands = list(candidates)
        if not cands:
            return None
        least = min(c.load for c in cands)
        bound = least + max(self.min_slack_tokens, int(least * self.slack))
        hashes = self.prefix_hashes(prompt_ids)
        close = [c for c in cands if c.load <= bound]
        best = max(close, key=lambda c: (self.matched_blocks(c.index, hashes), -c.load, -c.index))
        self._remember(best.index, hashes)
        return best.index

    def forget(self, index: int) -> None:
        """A replica was replaced: its cache is empty."""
        self._seen.pop(index, None)

    def _remember(self, index: int, hashes: list[int]) -> None:
        seen = self._seen.setdefault(index, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.memory:
            seen.popitem(last=False)
