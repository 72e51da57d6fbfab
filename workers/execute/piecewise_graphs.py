"""PiecewiseGraphs: steps with prompt chunks, their layers' dense parts replayed from CUDA graphs and attention
run eagerly between them.

An eager step of a 32-layer model is ~450 launches (norms, GEMMs, rotary, attention, the MLP). At ~30 µs of
host time a launch, that is ~15 ms, about half the GPU time of the mixed load's steady-state step: on a slower
host the launch outruns the GPU and the step waits on it. So, as vLLM does, the work between one layer's
attention and the next is captured once per token bucket: piece 0 is the embedding and layer 0 up to its
attention (norm, QKV, rotary, K/V write), piece i (0 < i < L) is layer i−1's o_proj and MLP then layer i up to
its attention, piece L is the last layer's o_proj and MLP. Attention, whose kernels and metadata depend on
every sequence's lengths, runs eagerly between two pieces; the final norm and LM head run eagerly on the
sampled rows. A step is then L + 1 graph launches and the attention's own launches.

Buckets are token counts (16 … 256 by 16s and 32s, then by 64s up to `max_tokens`); a step takes the smallest
that holds it, padded. Padded rows are id 0 at position 0 and write their K/V into the scratch block that the
decode graphs already pad into; attention reads only the step's own rows, and every other op is row-wise, so
padded rows never reach a real one. A GEMM is paid in tiles of 64 or more rows, so padding to a multiple of 64
costs its elementwise kernels only.

The pieces' inputs and outputs that cross the eager parts live in static buffers (token ids, positions,
slots; q; the attention output; the last hidden state and residual); what passes from one piece to the next
inside the graphs (the residual) stays in the graphs' pool, kept alive only while the next piece is captured,
so that the pool holds about one piece's working set, not one per layer. Every bucket shares the pool: only
one bucket runs at a time, in stream order.

With `capture=False` the pieces run eagerly through the same code (the CPU tests check the padded path
against the plain forward that way).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from mii_async.kernels.metadata import AttentionMetadata

from .capture_gc import gc_held

log = logging.getLogger("mii_async.workers.execute.piecewise_graphs")
MAX_TOKENS = 2048               # the largest bucket at most: a longer step is GPU-bound (a 2048-token step of the
                                # 8B shape takes ~45 ms on the GPU against ~15 ms to launch eagerly), and every
                                # bucket costs 33 captures (for 32 layers) and the pool grows with the largest


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, … 128 by 16s, then by 32s to 256, then by 64s, up to and including `max_tokens` (rounded up
    to a multiple of 64 past 256)."""
    out, b = [], 16
    while b < max_tokens:
        out.append(b)
        b += 16 if b < 128 else 32 if b < 256 else 64
    return out + [b]


def piecewise_reserve(model, max_tokens: int) -> int:
    """What the memory plan sets aside for the piecewise graphs of `model` before they exist: the static
    buffers and one piece's working set at the largest bucket (QKV, q, two residuals, the hidden state,
    gate|up and its SiLU, or with experts each token's top-k experts' share of those and of their permuted
    inputs and outputs), twice over for the allocator's rounding, plus 64 MiB."""
    spec, size = model.spec, model.embed.element_size()
    d, hidden, ffn = spec.head_dim, spec.hidden_size, spec.intermediate_size
    q_width, qkv_width = model.num_heads * d, (model.num_heads + 2 * model.num_kv_heads) * d
    m = token_buckets(max_tokens)[-1]
    static = m * (3 * 8 + (2 * q_width + 2 * hidden) * size)
    mlp = 3 * ffn
    if spec.moe is not None:
        mlp = max(mlp, spec.moe.top_k * (3 * spec.moe.moe_intermediate_size + 3 * hidden))
    piece = m * (qkv_width + q_width + 4 * hidden + mlp) * size
    return static + 2 * piece + (64 << 20)


class PiecewiseGraphs:
    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 max_tokens: int, scratch_slot: int, capture: bool = True, max_rows: int = 0) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.max_rows = max_rows                # the eager head is warmed at 1 … this many rows (warm_head)
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.scratch_slot = scratch_slot
        self.use_graphs = capture
        spec, m = model.spec, self.max_tokens
        dtype = model.embed.dtype
        q_width = model.num_heads * spec.head_dim
        # [ids | positions | slots] of the largest bucket; a bucket of P reads the first 3P as three fields
        self.io = torch.zeros(3 * m, dtype=torch.int64, device=device)
        self.io[2 * m:] = scratch_slot
        self.q = torch.zeros((m, q_width), dtype=dtype, device=device)      # pieces 0 … L−1 write it
        self.attn = torch.zeros((m, q_width), dtype=dtype, device=device)   # the eager attention writes it
        self.h = torch.zeros((m, spec.hidden_size), dtype=dtype, device=device)   # piece L writes them
        self.res = torch.zeros((m, spec.hidden_size), dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self.memory = 0
        self.capture_seconds = 0.0
        self.replays = 0

    def bucket(self, num_tokens: int) -> int:
        """The token bucket of a step of `num_tokens`, or 0 when it is larger than every bucket."""
        if num_tokens > self.max_tokens:
            return 0
        return next(b for b in self.buckets if b >= num_tokens)

    # -- the pieces ----------------------------------------------------------------------------------
    def _piece(self, i: int, p: int, residual: torch.Tensor | None) -> torch.Tensor | None:
        """Piece i of a bucket of p tokens; returns the residual it hands to piece i + 1."""
        model, io = self.model, self.io
        layers = model.layers
        if i == 0:
            h = model.embed_tokens(io[:p])
        else:
            h, residual = model.post_attention(layers[i - 1], self.attn[:p], residual)
            if i == len(layers):
                self.h[:p].copy_(h)
                self.res[:p].copy_(residual)
                return None
        k_cache, v_cache = self.kv_caches[i]
        q, residual = model.pre_attention(layers[i], h, residual, io[p:2 * p], io[2 * p:3 * p], k_cache, v_cache)
        self.q[:p].copy_(q.view(p, -1))
        return residual

    def _eager(self, p: int) -> None:
        """Every piece of a bucket, eagerly (what the graphs replay; attention not run)."""
        residual = None
        for i in range(len(self.model.layers) + 1):
            residual = self._piece(i, p, residual)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket's pieces, largest first, into one pool."""
        t0 = time.perf_counter()
        dev = self.device
        torch.cuda.synchronize(dev)
        free_before = torch.cuda.mem_get_info(dev)[0]
        self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        with gc_held():                                   # no finalizer may call into CUDA mid-capture
            for p in reversed(self.buckets):
                self.io[:2 * p] = 0                       # the bucket's ids and positions; its padded rows'
                self.io[2 * p:3 * p] = self.scratch_slot  # (here every row's) K/V into the scratch block
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):             # warm-up, off the capture: kernels compile, cuBLAS
                    self._eager(p)                        # picks its algorithms and sets up its workspaces
                torch.cuda.current_stream(dev).wait_stream(side)
                torch.cuda.synchronize(dev)
                pieces, residual = [], None
                for i in range(len(self.model.layers) + 1):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool):
                        nxt = self._piece(i, p, residual)
                    residual = nxt                        # the previous one is dropped: its memory is free for
                    pieces.append(g)                      # the pieces after the next (they run after it is read)
                self.graphs[p] = pieces
        torch.cuda.synchronize(dev)
        self.memory = max(0, free_before - torch.cuda.mem_get_info(dev)[0])
        self.warm_head(self.max_rows)                     # its blocks are the activations', not the graphs'
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured piecewise graphs for steps with prompt chunks (%d token buckets up to %d, %d pieces "
                 "each) in %.1f s, %.2f GiB", len(self.buckets), self.max_tokens, len(self.model.layers) + 1,
                 self.capture_seconds, self.memory / 2**30)

    @torch.inference_mode()
    def warm_head(self, max_rows: int) -> None:
        """Runs the eager head (final norm, LM head) once at every row count from 1 to `max_rows`. Unwarmed, a
        few steps of a load's ramp, as the sampled rows grew past any count seen before, held the host in the
        head for the step in flight and its own: 80-93 ms launches in the H100's mixed load, none in a second
        run of it in the same process, none after this warm-up. Most likely the first launch of a GEMM kernel
        that cuBLAS picks for a larger row count: CUDA loads a module lazily, and loading waits for the
        device. Rows past `max_num_seqs` (prompt positions scored for prompt logprobs) and fully eager steps
        are not warmed."""
        m = min(max_rows, self.max_tokens)
        if m < 1:
            return
        rows = torch.arange(m, device=self.device)
        for n in range(1, m + 1):
            self.model.head(self.h[:m], self.res[:m], rows[:n])

    # -- a step --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, io: torch.Tensor, num_tokens: int, meta: AttentionMetadata, sample_rows: torch.Tensor,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """A step of `num_tokens` tokens whose [ids | positions | slots] fields, padded to its bucket, are `io`
        (on the device, placeholders filled) → logits [len(sample_rows), V] fp32, as `DecoderModel.forward`."""
        p = io.shape[0] // 3
        t = num_tokens
        model = self.model
        hq, d = model.num_heads, model.spec.head_dim
        self.io[:3 * p].copy_(io)
        pieces = self.graphs.get(p) if self.use_graphs else None
        assert pieces is not None or not self.use_graphs, f"no piecewise graphs for {p} tokens"
        residual = None
        q, attn = self.q[:t].view(t, hq, d), self.attn[:t].view(t, hq, d)
        for i, (k_cache, v_cache) in enumerate(self.kv_caches):
            if pieces is not None:
                pieces[i].replay()
            else:
                residual = self._piece(i, p, residual)
            model.attention(model.layers[i], q, k_cache, v_cache, meta, out=attn)
            if between_layers is not None:
                between_layers()
        if pieces is not None:
            pieces[-1].replay()
        else:
            self._piece(len(self.kv_caches), p, residual)
        self.replays += 1
        return model.head(self.h[:p], self.res[:p], sample_rows)
