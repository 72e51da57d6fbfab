"""AttentionMetadata: where a step's tokens sit in the blocked KV cache.

Built once per step by the runner and shared by every layer. Sequences are ordered decodes first: the first
`num_decodes` sequences have exactly one query token each (decode, or a one-token prefill chunk), so their
tokens are rows [0, num_decodes) of the step.

The prompt chunks after them may also come as `prefill_groups`: for each group of consecutive chunks, the flat
cache slots of every key they attend to and the cumulative query / key lengths, which is what a variable-length
(ragged) attention kernel takes. The CUDA backend gathers each group's keys with one index and attends with one
call; the torch reference ignores the groups. `prefill_layout` builds them on the host.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

MAX_GROUP_KEYS = 16384      # keys gathered per group: bounds the gather's transient memory per layer


class PrefillGroup(NamedTuple):
    rows: tuple[int, int]       # the group's query rows [start, end) in the step
    kv_slots: torch.Tensor      # [Σ context] int64: the flat cache slot of each key, sequence after sequence
    cu_q: torch.Tensor          # [n + 1] int32: prefix sums of the group's query lengths
    cu_k: torch.Tensor          # [n + 1] int32: prefix sums of its context lengths
    max_q: int
    max_k: int


class _AttentionFields(NamedTuple):
    slot_mapping: torch.Tensor      # [num_tokens] int64: block_id * block_size + offset where each token's K/V goes
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int64: each sequence's blocks, padded with 0
    context_lens: torch.Tensor      # [num_seqs] int64: keys per sequence after this step's tokens are written
    query_start_loc: torch.Tensor   # [num_seqs + 1] int64: prefix sums of query lengths
    num_decodes: int                # leading sequences with one query token
    max_context_len: int            # max(context_lens)
    query_lens: list[int]           # host copy of the query lengths (the reference loops over prefills)
    context_lens_host: list[int]    # host copy of context_lens
    prefill_groups: tuple[PrefillGroup, ...] | None = None   # the prompt chunks for a ragged kernel


class AttentionMetadata(_AttentionFields):
    """The fields above, and `memo`: what an op set derives from them once and every layer reuses."""

    @property
    def memo(self) -> dict[object, object]:
        """Derived per-step state (the CPU decode plan, per window and block size), kept on the metadata so
        that it lives as long as the step does; `_replace` gives a new, empty one."""
        return self.__dict__


class HostGroup(NamedTuple):
    """A PrefillGroup on the host: offsets into the int64 array `prefill_layout` returns."""
    rows: tuple[int, int]
    slots: tuple[int, int]      # [start, end) of the kv slots
    cu: int                     # start of cu_q then cu_k, int32, n + 1 each: n + 1 int64 words
    n: int
    max_q: int
    max_k: int


def prefill_layout(tables: np.ndarray, query_lens: list[int], context_lens: list[int], num_decodes: int,
                   block_size: int, max_group_keys: int = MAX_GROUP_KEYS) -> tuple[np.ndarray, list[HostGroup]]:
    """The prompt chunks of a step (sequences from `num_decodes` on) as groups of consecutive chunks holding
    at most `max_group_keys` keys each (a longer context is a group of its own). `tables` [S, W] int64 host
    block tables. Returns one int64 array holding every group's slots and int32 cumulative lengths, and where
    each group's parts sit in it."""
    nd, n = num_decodes, len(query_lens)
    groups: list[list[int]] = []
    keys = 0
    for s in range(nd, n):
        if not groups or keys + context_lens[s] > max_group_keys:
            groups.append([])
            keys = 0
        groups[-1].append(s)
        keys += context_lens[s]
    total = sum(context_lens[nd:])
    out = np.empty(total + sum(len(g) + 1 for g in groups), np.int64)
    clens = np.asarray(context_lens[nd:], np.int64)
    seq_of = np.repeat(np.arange(nd, n), clens)
    starts = np.zeros(n - nd, np.int64)
    np.cumsum(clens[:-1], out=starts[1:])
    pos = np.arange(total) - np.repeat(starts, clens)
    out[:total] = tables[seq_of, pos // block_size] * block_size + pos % block_size
    at, row, placed = total, nd, []
    for g in groups:
        ql = [query_lens[s] for s in g]
        cl = [context_lens[s] for s in g]
        k = len(g) + 1
        cu = out[at:at + k].view(np.int32)                      # cu_q [k] then cu_k [k], int32
        cu[0] = cu[k] = 0
        np.cumsum(ql, out=cu[1:k])
        np.cumsum(cl, out=cu[k + 1:2 * k])
        first = int(starts[g[0] - nd])
        placed.append(HostGroup((row, row + sum(ql)), (first, first + sum(cl)), at, len(g), max(ql), max(cl)))
        row += sum(ql)
        at += k
    return out, placed


def device_groups(buf: torch.Tensor, groups: list[HostGroup]) -> tuple[PrefillGroup, ...]:
    """The groups as views of `buf`, the device copy of `prefill_layout`'s array."""
    out = []
    for g in groups:
        k = g.n + 1
        cu = buf[g.cu:g.cu + k].view(torch.int32)               # k int64 words = 2k int32
        out.append(PrefillGroup(g.rows, buf[g.slots[0]:g.slots[1]], cu[:k], cu[k:2 * k], g.max_q, g.max_k))
    return tuple(out)
