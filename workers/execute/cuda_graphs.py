"""DecodeGraphs: decode steps replayed from CUDA graphs captured at bucketed batch sizes.

A decode step launches a few hundred small kernels; replaying them from a graph removes the host's launch cost.
Each graph is captured for a batch bucket (1, 2, 4, 8, 16, 24, 32, 48, … up to the largest batch) and a
context cap (the decode kernel's split count is fixed at capture); a step takes the smallest graph that holds
it, padded: padded rows attend to one token of a scratch KV block that no sequence owns, and their logits are
dropped. Inputs live in one persistent device buffer per cap, filled from a pinned host mirror with one copy
per step.

The caps are 512, 2048 and 8192 tokens for every bucket; past 8192, caps four times larger up to the model's
context (32k, 128k, …) hold the buckets of up to LONG_CAP_BATCH sequences, so that a long document's decode
at a small batch keeps the graph path (the skinny GEMVs, no launch cost). Without them such a step would run
through the piecewise graphs, whose smallest bucket pads it to 16 rows of cuBLAS GEMMs. A large batch at
long contexts is bound by its K/V reads, and its splits' partial outputs would be large; it runs through the
piecewise graphs, as do steps with prompt chunks (eagerly where those are off).

Graphs are captured on torch's graph pool; CuPy kernels launch on torch's current stream and are captured with
the rest (kernels/cuda.py).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from mii_async.kernels.metadata import AttentionMetadata

from .capture_gc import gc_held
from .runner import fill_pending, pack_tables, placeholders
from ..core.step_plan import StepPlan

log = logging.getLogger("mii_async.workers.execute.cuda_graphs")
CONTEXT_CAPS = (512, 2048, 8192)  # every bucket; a short cap keeps the split count (fixed at capture) small
                                  # for short contexts
LONG_CAP_STEP = 4                # past CONTEXT_CAPS, each cap this many times the one before, up to the context
LONG_CAP_BATCH = 8               # the largest bucket a cap past CONTEXT_CAPS holds
_FIELDS = 6                      # ids, positions, slots, context lengths, placeholder rows and sources (async
                                 # scheduling); then the block tables


def graph_reserve(max_batch: int, vocab_size: int, max_context: int = 0, num_heads: int = 0,
                  head_dim: int = 0) -> int:
    """What the memory plan sets aside for the graphs before they exist: the persistent logits, twice the
    biggest graph's logits in the pool (fp32 and the model dtype), 256 MiB for the rest of its step, and, past
    CONTEXT_CAPS, the longest cap's decode splits (fp32 partial outputs, maxima and sums of each query head, in
    the 512-token splits that a batch of sequences over such a cap takes), which would outgrow the 256 MiB at a
    context of about a million tokens."""
    long_caps = context_caps(max_context, max_batch)[len(CONTEXT_CAPS):] if max_context > CONTEXT_CAPS[-1] else []
    splits = max((b * num_heads * -(-c // 512) * (head_dim + 2) * 4 for c, b in long_caps), default=0)
    return 3 * max_batch * vocab_size * 4 + (256 << 20) + splits


def context_caps(max_context: int, max_batch: int) -> list[tuple[int, int]]:
    """(cap, largest batch) of each context cap, shortest first, for a model of `max_context` tokens: the
    CONTEXT_CAPS (or the context, where shorter) for every batch, then caps LONG_CAP_STEP times longer, the last
    one the context itself, for up to LONG_CAP_BATCH sequences."""
    caps = sorted({min(c, max_context) for c in CONTEXT_CAPS})
    out = [(c, max_batch) for c in caps]
    c = caps[-1]
    while c < max_context:
        c = min(c * LONG_CAP_STEP, max_context)
        out.append((c, min(max_batch, LONG_CAP_BATCH)))
    return out


def batch_buckets(max_batch: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    b = 16
    while b < max_batch:
        out.append(b)
        b += 8 if b < 32 else 16 if b < 64 else 32
    return out + [max_batch]


class _Cap:
    """The persistent inputs and the graphs of one context cap.

    Two pinned host mirrors, used in turn: with async scheduling the next step's inputs are written while the
    copy of this step's may still be queued on the device; the one before it has run by then (its ids were
    read)."""

    def __init__(self, cap: int, max_batch: int, block_size: int, scratch_block: int, device: torch.device) -> None:
        self.cap, self.width, self.max_batch = cap, -(-cap // block_size), max_batch
        n = _FIELDS * max_batch + max_batch * self.width
        self.hosts = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.nps = [h.numpy() for h in self.hosts]
        for a in self.nps:
            a[:] = 0
            a[2 * max_batch:3 * max_batch] = scratch_block * block_size   # warm-up writes hit the scratch block
            a[3 * max_batch:4 * max_batch] = 1
            a[_FIELDS * max_batch:] = scratch_block      # every table entry a valid block
        self.turn = 0
        self.buckets = batch_buckets(max_batch)
        self.dev = self.hosts[0].to(device)
        b = max_batch
        self.ids, self.pos, self.slots, self.clens = (self.dev[i * b:(i + 1) * b] for i in range(4))
        self.patch = self.dev[4 * b:6 * b]               # placeholder rows and their sources (not graph inputs)
        self.tables = self.dev[_FIELDS * b:].view(b, self.width)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}


class DecodeGraphs:
    def __init__(self, model, kv_caches, block_size: int, device: torch.device, max_batch: int,
                 max_context: int, scratch_block: int) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.scratch_slot = scratch_block * block_size
        self.buckets = batch_buckets(max_batch)
        self.caps = [_Cap(c, b, block_size, scratch_block, device) for c, b in context_caps(max_context, max_batch)]
        self.rows = torch.arange(max_batch + 1, device=device)   # sampled rows, and query_start_loc
        self.pool = None
        self.logits: torch.Tensor | None = None   # [max_batch, V] fp32, written by every graph
        self.memory = 0                  # bytes the captured graphs hold (measured)
        self.capture_seconds = 0.0
        self.replays = 0

    def capture(self) -> None:
        """Captures every (cap, bucket) graph, the largest (batch × cap) first, so that smaller ones reuse its
        pool memory (a long cap's few sequences before the 8192 cap's many)."""
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        with gc_held():                                   # no finalizer may call into CUDA mid-capture
            for cap, b in sorted(((c, b) for c in self.caps for b in c.buckets), key=lambda cb: cb[0].cap * cb[1],
                                 reverse=True):
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):         # warm-up, off the capture: kernels compile, cuBLAS
                    out = self._forward(cap, b)       # sets up its workspaces
                torch.cuda.current_stream(self.device).wait_stream(side)
                if self.logits is None:
                    self.logits = torch.empty((self.buckets[-1], out.shape[1]), dtype=out.dtype,
                                              device=self.device)
                del out
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self.logits[:b].copy_(self._forward(cap, b))
                cap.graphs[b] = g
        torch.cuda.synchronize(self.device)
        self.memory = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d decode graphs (batches %s; context caps %s, each up to the batch given) in %.1f s, "
                 "%.2f GiB", sum(len(c.graphs) for c in self.caps), self.buckets,
                 [(c.cap, c.max_batch) for c in self.caps], self.capture_seconds, self.memory / 2**30)

    def _forward(self, cap: _Cap, b: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=cap.slots[:b], block_tables=cap.tables[:b],
                                 context_lens=cap.clens[:b], query_start_loc=self.rows[:b + 1], num_decodes=b,
                                 max_context_len=cap.cap, query_lens=[1] * b, context_lens_host=[cap.cap] * b)
        return self.model.forward(cap.ids[:b], cap.pos[:b], self.kv_caches, meta, self.rows[:b])

    def run(self, plan: StepPlan, pending: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [len(plan.seqs), V] of a decode-only step from its graph; None when no graph fits it.
        `pending`: the ids of the step in flight, which placeholder ids stand for (async scheduling)."""
        n = len(plan.seqs)
        # A graph returns a row's logits for every row, so each must be sampled: a one-token row that is not
        # (a prompt chunk cut to one token) sends the step to the eager path, wherever it sits in the plan.
        if (plan.num_decodes != n or n > self.buckets[-1] or plan.num_scored
                or not all(s.sample for s in plan.seqs)):
            return None
        starts = [s.start_pos for s in plan.seqs]
        longest = max(starts) + 1
        cap = next((c for c in self.caps if c.cap >= longest and c.max_batch >= n), None)
        if cap is None:
            return None
        b = next(x for x in cap.buckets if x >= n)
        m, w, a = cap.max_batch, cap.width, cap.nps[cap.turn]
        ids, pos, slots, clens = (a[i * m:i * m + b] for i in range(4))
        tables = a[_FIELDS * m:].reshape(m, w)
        bs = self.block_size
        # The whole batch in a few numpy calls (no per-row element writes): rows past a table's end, and
        # blocks past the cap (which hold no token it reads), point at the scratch block.
        table, _ = pack_tables(plan.seqs, self.scratch_slot // bs)
        k = min(table.shape[1], w)
        tables[:n, :k] = table[:, :k]
        ids[:n] = [s.token_ids[0] for s in plan.seqs]
        pos[:n] = starts
        p = pos[:n]
        slots[:n] = table[np.arange(n), p // bs] * bs + p % bs
        clens[:n] = p + 1
        ids[n:], pos[n:], slots[n:], clens[n:] = 0, 0, self.scratch_slot, 1
        k = 0
        if pending is not None:
            rows, sources = placeholders(ids[:n])
            k = len(rows)
            a[4 * m:4 * m + k], a[5 * m:5 * m + k] = rows, sources
        used = _FIELDS * m + b * w
        cap.dev[:used].copy_(cap.hosts[cap.turn][:used], non_blocking=True)
        cap.turn ^= 1
        if k:
            fill_pending(cap.ids, cap.patch[:k], cap.patch[m:m + k], pending)
        cap.graphs[b].replay()
        self.replays += 1
        return self.logits[:n]
