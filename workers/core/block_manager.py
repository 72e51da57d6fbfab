"""Blocked KV cache bookkeeping: free list, reference counts, prefix cache. Ints only, no tensors.

Invariants (checked by `check_invariants` in tests):
- a block is either free (in `_free`, ref count 0) or referenced (ref count = number of sequences whose block
  table holds it); never both, never lost;
- a cached block (one with a prefix hash) may be free: it stays findable until it is evicted, least recently
  freed first, when a fresh block is needed;
- a block's hash covers its own tokens and, by chaining, every token before it, so a hit on block i implies
  hits on blocks 0 … i-1.

The hash is a keyed 128-bit BLAKE2b of (parent digest, token ids), the key drawn at random per process: no
prompt can be crafted to collide with another's prefix and be served its K/V (Python's `hash()` of ints is
public arithmetic, the weakness of vLLM's CVE-2025-25183). About 1 µs a block, once when it fills and once
per admission lookup.
"""
from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from typing import Iterable, NamedTuple

from .sequence import Sequence

_KEY = os.urandom(32)
_ROOT = bytes(16)                  # the parent digest of a sequence's first block


def block_digest(parent: bytes | None, token_ids: list[int]) -> bytes:
    """The chained digest of a full block: its tokens and, through `parent`, every token before them."""
    h = hashlib.blake2b(parent or _ROOT, digest_size=16, key=_KEY)
    h.update(array("I", token_ids))           # ids are checked to lie in [0, 2³²) where requests come in
    return h.digest()


class CacheStats(NamedTuple):
    num_blocks: int
    num_free: int            # free blocks (including cached ones that are evictable)
    num_cached: int          # blocks currently holding a registered prefix
    hit_tokens: int          # prompt tokens served from the cache, since start
    query_tokens: int        # prompt tokens looked up, since start


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0, "a KV pool needs blocks"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        # Free blocks in eviction order: the front is taken first. Uncached blocks go to the front, cached
        # ones to the back, so a cached prefix survives as long as possible.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, bytes] = {}        # block → its chained digest
        self._block_of: dict[bytes, int] = {}       # chained digest → block
        self.hit_tokens = 0
        self.query_tokens = 0

    # -- queries -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def max_appendable(self, seq: Sequence) -> int:
        """How many new tokens `seq` could take now: the slack in its last block plus the free blocks."""
        slack = len(seq.block_table) * self.block_size - seq.num_computed_tokens
        return slack + self.num_free * self.block_size

    def stats(self) -> CacheStats:
        return CacheStats(self.num_blocks, self.num_free, len(self._hash_of), self.hit_tokens, self.query_tokens)

    # -- allocation ----------------------------------------------------------------------------------
    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Gives `seq` the blocks its next `num_new_tokens` need; the caller checked they are free."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > 0:
            seq.block_table += self.take(need)

    def take(self, n: int) -> list[int]:
        """`n` fresh blocks (ref count 1), in the order `append` would hand them out one by one; the caller
        puts them in block tables. One call for a whole step's decodes instead of one per sequence."""
        assert n <= len(self._free), f"take of {n} blocks with {len(self._free)} free"
        free, ref, hash_of = self._free, self._ref, self._hash_of
        out = []
        for _ in range(n):
            block, _ = free.popitem(last=False)
            if block in hash_of:
                self._evict(block)
            ref[block] = 1
            out.append(block)
        return out

    def shrink(self, seq: Sequence, num_new_tokens: int) -> None:
        """Gives back the blocks at the end of `seq`'s table that its next `num_new_tokens` do not need: an
        `append` of more tokens, undone in part before the step runs. Those blocks were just taken, so they
        return to the front of the free list in the order `take` handed them out."""
        keep = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            assert self._ref[block] == 1 and block not in self._hash_of, f"shrink of a shared block {block}"
            self._ref[block] = 0
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Releases every block of `seq` (finish, abort, preemption). Tail blocks are evicted first."""
        for block in reversed(seq.block_table):
            self._ref[block] -= 1
            assert self._ref[block] >= 0, f"block {block} released twice"
            if self._ref[block] == 0:
                self._free[block] = None
                if block not in self._hash_of:
                    self._free.move_to_end(block, last=False)
        seq.block_table = []

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            if self._block_of.get(h) == block:
                del self._block_of[h]

    # -- prefix cache --------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        """Forgets every free block's prefix (a benchmark's rerun must not find its prompts cached); blocks
        that sequences hold stay findable. Returns how many blocks were forgotten."""
        gone = [b for b in self._free if b in self._hash_of]
        for b in gone:
            self._evict(b)
        return len(gone)

    def match_prefix(self, seq: Sequence) -> None:
        """At admission of a sequence with no blocks: takes the cached blocks of its longest cached prefix
        of full blocks, leaving at least one token to compute (its logits give the next token)."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "match_prefix on a sequence with blocks"
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if seq.prompt_lps is not None:             # prompt logprobs: a position not scored yet needs its logits
            max_blocks = min(max_blocks, seq.num_scored // self.block_size)
        if not self.enable_prefix_caching:
            return
        parent: bytes | None = None
        for i in range(max_blocks):
            h = block_digest(parent, seq.token_ids(i * self.block_size, (i + 1) * self.block_size))
            block = self._block_of.get(h)
            if block is None:
                break
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
            seq.block_table.append(block)
            parent = h
        n = len(seq.block_table)
        seq.num_computed_tokens = n * self.block_size
        seq.num_hashed_blocks, seq.last_block_hash = n, parent

    def admitted(self, seq: Sequence) -> None:
        """Counts a match_prefix that the scheduler kept (one it gave back, the queue's head waiting for blocks,
        is tried again next step and counted then). A request's `num_cached_prompt_tokens` (its usage) is
        its first admission's: a recompute after preemption serves it nothing new."""
        hit = min(seq.num_computed_tokens, seq.prompt_len)
        self.query_tokens += seq.prompt_len
        self.hit_tokens += hit
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = hit

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: records the hash of every block of `seq` that is now full of computed tokens whose
        ids are known (a placeholder of async scheduling waits until its token is read)."""
        full = min(seq.num_computed_tokens, seq.num_tokens - seq.num_pending) // self.block_size
        if not self.enable_prefix_caching or full <= seq.num_hashed_blocks:
            return                        # the usual decode step: no block filled up
        for i in range(seq.num_hashed_blocks, full):
            h = block_digest(seq.last_block_hash, seq.token_ids(i * self.block_size, (i + 1) * self.block_size))
            block = seq.block_table[i]
            if h not in self._block_of:   # an identical block computed concurrently keeps the entry
                self._block_of[h] = block
                self._hash_of[block] = h
            seq.last_block_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # -- checks --------------------------------------------------------------------------------------
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        owners = [0] * self.num_blocks
        for s in seqs:
            assert len(set(s.block_table)) == len(s.block_table), f"seq {s.req_id} holds a block twice"
            for b in s.block_table:
                owners[b] += 1
        for b in range(self.num_blocks):
            assert owners[b] == self._ref[b], f"block {b}: ref {self._ref[b]} but {owners[b]} owners"
            assert (b in self._free) == (self._ref[b] == 0), f"block {b}: free={b in self._free} ref={self._ref[b]}"
        for h, b in self._block_of.items():
            assert self._hash_of.get(b) == h, f"hash table entry of block {b} is stale"
