"""Runner: StepPlan → input tensors → forward → logits of the sampled rows (then of the rows scored for prompt
logprobs). Makes no scheduling decision.

The step's inputs are built on the host with a few numpy calls over the whole batch (not per-sequence tensor
ops), packed into one int64 buffer and moved to the device with one copy: at 256 sequences a step's host
work is the bottleneck on a GPU, not its kernels.

On a GPU the runner owns its CUDA graphs: the builder says which and how large (a `GraphPlan`), the runner
captures them over its KV pool (`capture`) and replays them where a step fits one (`execute`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from mii_async.kernels.metadata import AttentionMetadata, HostGroup, device_groups, prefill_layout

from ..model.decoder import DecoderModel
from .staging import Staging
from ..core.step_plan import ScheduledSeq, StepPlan

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphs
    from .piecewise_graphs import PiecewiseGraphs


def pack_tables(seqs: list[ScheduledSeq], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Block tables as one padded array [len(seqs), longest table] int64 (filled with `pad`), and their
    lengths [len(seqs)]."""
    lens = np.fromiter(map(len, (s.block_table for s in seqs)), np.int64, len(seqs))
    flat = np.fromiter(chain.from_iterable(s.block_table for s in seqs), np.int64, int(lens.sum()))
    width = int(lens.max())
    tables = np.full((len(seqs), width), pad, np.int64)
    tables[np.arange(width) < lens[:, None]] = flat        # row-major: each row's blocks, in order
    return tables, lens


class HostInputs(NamedTuple):
    """A step's inputs on the host: one int64 buffer and where each field sits in it."""
    buf: np.ndarray            # [3P + S + (S + 1) + R + E + S·W] ids, positions, slots (each P long: T, or
                               # padded to a piecewise graph's P), context lens, query starts, sampled rows
                               # then scored rows (prompt logprobs), block tables
    num_tokens: int            # T
    num_sampled: int           # R
    num_scored: int            # E
    width: int                 # W, blocks per padded table row
    query_lens: list[int]      # [S] host copies the attention metadata carries
    context_lens: list[int]    # [S]
    groups: list[HostGroup]    # the prompt chunks' ragged layout (`prefill_layout`), after the tables; or []
    patch: int                 # placeholder ids (async scheduling): [patch] their rows, then their sources, last
    padded: int                # P: the length of the ids, positions and slots fields (≥ T)


def host_inputs(plan: StepPlan, block_size: int, ragged: bool = False, pending: bool = False, pad_to: int = 0,
                pad_slot: int = 0) -> HostInputs:
    """The step's int64 inputs: per-sequence Python work is one read of each field; positions, slots and
    sampled rows are computed for the whole batch by numpy. With `ragged`, the prompt chunks' layout for a
    variable-length attention kernel follows the block tables. With `pending`, ids may be placeholders
    (−1 − r: the r-th id the step in flight samples): their rows and sources end the buffer. `pad_to`: the
    ids, positions and slots fields are that long, the rows past the step's tokens id 0 at position 0,
    writing their K/V to `pad_slot` (a piecewise graph's padded rows)."""
    seqs = plan.seqs
    n = len(seqs)
    starts = [s.start_pos for s in seqs]
    if plan.num_decodes == n:                          # decode-only: one token per sequence
        qlens = [1] * n
        ids = [s.token_ids[0] for s in seqs]
    else:
        qlens = [len(s.token_ids) for s in seqs]
        ids = list(chain.from_iterable(s.token_ids for s in seqs))
    clens = [a + b for a, b in zip(starts, qlens)]
    tables, lens = pack_tables(seqs, 0)
    num_tok, width = len(ids), tables.shape[1]
    p_len = max(pad_to, num_tok)
    sample = np.fromiter((s.sample for s in seqs), np.bool_, n)
    num_sampled = int(sample.sum())
    num_scored = plan.num_scored
    groups: list[HostGroup] = []
    layout = None
    num_rows = num_sampled + num_scored
    base = 3 * p_len + 2 * n + 1 + num_rows + n * width
    if ragged and plan.num_decodes < n:
        layout, groups = prefill_layout(tables, qlens, clens, plan.num_decodes, block_size)
        groups = [g._replace(slots=(g.slots[0] + base, g.slots[1] + base), cu=g.cu + base) for g in groups]
    rows, sources = placeholders(np.asarray(ids, np.int64)) if pending else (None, None)
    npatch = 0 if rows is None else len(rows)
    end = base + (0 if layout is None else len(layout))
    buf = np.empty(end + 2 * npatch, np.int64)
    o = p_len
    ids_v, pos_v, slots_v = buf[:num_tok], buf[o:o + num_tok], buf[2 * o:2 * o + num_tok]
    if p_len > num_tok:
        buf[num_tok:o] = 0
        buf[o + num_tok:2 * o] = 0
        buf[2 * o + num_tok:3 * o] = pad_slot
    o *= 3
    clens_v, qsl_v = buf[o:o + n], buf[o + n:o + 2 * n + 1]
    o += 2 * n + 1
    rows_v = buf[o:o + num_rows]
    tables_v = buf[o + num_rows:base].reshape(n, width)
    if layout is not None:
        buf[base:end] = layout
    if npatch:
        buf[end:end + npatch] = rows
        buf[end + npatch:] = sources
    ids_v[:] = ids
    clens_v[:] = clens
    assert ((clens_v + block_size - 1) // block_size <= lens).all(), "a block table does not cover its tokens"
    qsl_v[0] = 0
    np.cumsum(qlens, out=qsl_v[1:])
    rows_v[:num_sampled] = qsl_v[1:][sample] - 1       # each sampled sequence's last token
    if num_scored:                                     # then the rows scored for prompt logprobs
        rows_v[num_sampled:] = list(chain.from_iterable(range(q + s.score_from, q + s.score_to)
                                                        for q, s in zip(qsl_v[:-1].tolist(), seqs)))
    tables_v[:] = tables
    if num_tok == n:
        pos_v[:] = starts
        seq_of = np.arange(n)
    else:                                              # token t of sequence s sits at start_s + t - qsl_s
        seq_of = np.repeat(np.arange(n), qlens)
        np.subtract(np.arange(num_tok), qsl_v[:-1][seq_of], out=pos_v)
        pos_v += np.asarray(starts, np.int64)[seq_of]
    slots_v[:] = tables[seq_of, pos_v // block_size] * block_size + pos_v % block_size
    return HostInputs(buf, num_tok, num_sampled, num_scored, width, qlens, clens, groups, npatch, p_len)


def placeholders(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `ids` that hold placeholders (−1 − r), and each one's r: its row in the step in flight."""
    rows = np.flatnonzero(ids < 0)
    return rows, -1 - ids[rows]


def fill_pending(ids: torch.Tensor, rows: torch.Tensor, sources: torch.Tensor, pending: torch.Tensor | None) -> None:
    """Writes the placeholder rows of `ids` on the device: ids[rows] = pending[sources]."""
    assert pending is not None, "placeholder ids in a plan without the step they wait on"
    ids.index_copy_(0, rows, pending.index_select(0, sources))


@dataclass(frozen=True)
class GraphPlan:
    """Which CUDA graphs a runner captures, and how large: decode graphs always, piecewise graphs (steps with
    prompt chunks) when `piecewise_tokens` > 0. Fixed before the KV pool is sized, since the memory plan sets
    their `reserve` aside."""
    max_batch: int              # sequences in the largest decode graph; larger decode steps run eagerly
    max_context: int            # tokens of context the largest decode graph covers (max_model_len)
    piecewise_tokens: int       # tokens of the largest piecewise step (rounded up to its bucket); 0: none
    max_rows: int               # sampled rows the piecewise graphs' eager head is warmed at (max_num_seqs)

    def __post_init__(self) -> None:
        assert self.max_batch >= 1 and self.max_context >= 1, f"a decode graph needs a batch and a context: {self}"
        assert self.piecewise_tokens >= 0 and self.max_rows >= 0, f"negative piecewise sizes: {self}"

    def reserve(self, model: DecoderModel) -> int:
        """Bytes the memory plan sets aside for these graphs of `model` before they exist."""
        from .cuda_graphs import graph_reserve              # here: cuda_graphs imports this module (`capture`)
        from .piecewise_graphs import piecewise_reserve

        spec = model.spec                                   # every head: an upper bound under tensor parallelism
        return (graph_reserve(self.max_batch, spec.vocab_size, self.max_context, spec.num_heads, spec.head_dim)
                + (piecewise_reserve(model, self.piecewise_tokens) if self.piecewise_tokens else 0))


class Runner:
    def __init__(self, model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        # Both kinds of graphs replay while set; a probe may set either to None (eager) and back.
        self.graphs: DecodeGraphs | None = None           # decode-only steps, once captured (`capture`)
        self.piecewise: PiecewiseGraphs | None = None     # steps with prompt chunks: the layers' dense parts
                                                          # replayed, attention eager between them
        self.ragged = getattr(model.ops, "RAGGED_PREFILL", False)   # the op set takes prefill_groups
        self.staging = Staging(device) if device.type != "cpu" else None
        self.step_threads: Callable[[int], None] | None = None   # CPU: sets the threads for a step of N tokens

    def capture(self, plan: GraphPlan, scratch_block: int) -> None:
        """Captures the graphs `plan` asks for over this runner's KV pool: the decode graphs, then the
        piecewise graphs (which pad into the same scratch block). `scratch_block`: a block of the pool that no
        sequence owns, where padded rows write their K/V. Run it last in building: the graphs read the pool
        and the model as they are now."""
        # Imported here: cuda_graphs imports this module's host-input helpers (pack_tables, placeholders).
        from .cuda_graphs import DecodeGraphs
        from .piecewise_graphs import PiecewiseGraphs

        assert self.device.type == "cuda", f"CUDA graphs on a {self.device.type} runner"
        assert scratch_block < self.kv_caches[0][0].shape[0], "the scratch block is outside the KV pool"
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, self.device, plan.max_batch,
                                   plan.max_context, scratch_block=scratch_block)
        self.graphs.capture()
        if plan.piecewise_tokens:
            self.piecewise = PiecewiseGraphs(self.model, self.kv_caches, self.device, plan.piecewise_tokens,
                                             scratch_block * self.block_size, max_rows=plan.max_rows)
            self.piecewise.capture()

    @property
    def graph_memory(self) -> int:
        """Bytes the graphs set on this runner took when captured (measured; the memory plan reserved its
        estimate)."""
        return sum(g.memory for g in (self.graphs, self.piecewise) if g is not None)

    def upload(self, buf: np.ndarray) -> torch.Tensor:
        """The step's host inputs on the device: on a GPU one asynchronous copy from a persistent pinned buffer
        (no sync here; the sampler's one read-back per step is the sync)."""
        if self.staging is None:
            return torch.from_numpy(buf)
        return self.staging.upload(buf)

    def execute(self, plan: StepPlan, pending: torch.Tensor | None = None,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """Runs one step; returns logits [number of sampled seqs + plan.num_scored, V]: the sampled rows in plan
        order, then the rows scored for prompt logprobs, in plan order. `pending`: the ids the step
        in flight samples, on the device, which placeholder ids in the plan stand for (async scheduling).
        `between_layers`: called after each layer's launches of an eager or piecewise forward (not a decode
        graph's replay)."""
        if self.graphs is not None:
            logits = self.graphs.run(plan, pending)
            if logits is not None:
                return logits
        if self.step_threads is not None:
            self.step_threads(plan.num_tokens)
        pw = self.piecewise
        pad = pw.bucket(plan.num_tokens) if pw is not None else 0
        h = host_inputs(plan, self.block_size, self.ragged, pending is not None, pad,
                        pw.scratch_slot if pad else 0)
        buf = self.upload(h.buf)
        t, n, r, w, p = h.num_tokens, len(h.query_lens), h.num_sampled + h.num_scored, h.width, h.padded
        if h.patch:
            fill_pending(buf[:t], buf[-2 * h.patch:-h.patch], buf[-h.patch:], pending)
        o = 3 * p + 2 * n + 1                         # [P] ids, positions, slots; [S] clens; [S+1] qsl
        meta = AttentionMetadata(slot_mapping=buf[2 * p:2 * p + t],
                                 block_tables=buf[o + r:o + r + n * w].view(n, w),
                                 context_lens=buf[3 * p:3 * p + n], query_start_loc=buf[3 * p + n:o],
                                 num_decodes=plan.num_decodes, max_context_len=max(h.context_lens),
                                 query_lens=h.query_lens, context_lens_host=h.context_lens,
                                 prefill_groups=device_groups(buf, h.groups) if h.groups else None)
        if pad:
            return pw.forward(buf[:3 * p], t, meta, buf[o:o + r], between_layers)
        return self.model.forward(buf[:t], buf[p:p + t], self.kv_caches, meta, buf[o:o + r], between_layers)
