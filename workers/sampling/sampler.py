"""Sampler: logits processing and token choice for one step's sampled rows.

Order: a guided row's guide masks every token that would leave it, and allowed_token_ids every token outside
them → logprobs are taken here, of these raw logits (vLLM's default `raw_logprobs`, and the values
prompt_logprobs give) → repetition penalty over prompt + output (HF) → presence/frequency penalties over the
output (OpenAI) → logit_bias is added → min_new_tokens masks the end ids → temperature, top-k, top-p, min-p →
choice. Greedy rows take the argmax of the processed
logits. (A mask commutes with the penalties and the bias: −inf stays −inf.)

Random choice is the exponential race (argmax p_i / E_i with E_i ~ Exp(1)), which equals sampling from p.
A request with a `seed` owns a torch.Generator, so its draws never depend on what else is in the batch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mii_async.outputs import Logprob

from .guides import guide_masks
from ..core.sequence import Sequence, Status


def _plain(s: Sequence) -> bool:
    """Nothing but the argmax of the raw logits: a row restricted to allowed_token_ids needs its mask too."""
    return s.plain and s.params.allowed_token_ids is None


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value, the first on ties (as torch.argmax). On CPU, `max(-1)` takes
    0.4 ms over [32, 49152] fp32 against argmax's 1.05, and 0.6 ms against 2.65 in bf16 (torch 2.13, 2 cores);
    on CUDA, argmax."""
    return x.max(-1).indices if x.device.type == "cpu" else torch.argmax(x, -1)


def to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on `device`, without waiting on it: `torch.tensor(..., device=cuda)` copies
    from pageable memory and synchronizes the stream (with async scheduling, on the whole step in flight); a
    pinned copy is queued instead (torch keeps the pinned block until the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    return t


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[Logprob | None]       # per row, when its request asked: the chosen token's logprob, the n most
                                         # likely (id, logprob) best first, its rank (tokens at least as likely,
                                         # itself included); no texts (the router gives them)


class PendingSample(NamedTuple):
    """A step's choice, enqueued on the device and not read yet."""
    token_ids: torch.Tensor              # [S] int64 on the device
    num_rows: int
    logprobs: tuple | None = None        # (rows, n per row, own [L], top values [L, k], top ids [L, k], ranks [L])
    host: tuple = ()                     # the ids, then own / top values / top ids / ranks, as queued host copies
    ready: object = None                 # a torch.cuda.Event recorded after those copies; None on the CPU

    def is_ready(self) -> bool:
        """Whether `resolve` would return without waiting (on the CPU the ids exist as soon as launched)."""
        return self.ready is None or self.ready.query()


def _staged(ids: torch.Tensor, num_rows: int, logprobs: tuple | None = None) -> PendingSample:
    """Queues the step's device → host copies into pinned memory behind an event. Reading `ids.tolist()`
    instead would be a synchronous copy on the stream, which under async scheduling already holds the next
    step: the read would wait for that step too, and the device would idle while the host plans the one after."""
    tensors = (ids, *logprobs[2:]) if logprobs is not None else (ids,)
    if ids.device.type != "cuda":
        return PendingSample(ids, num_rows, logprobs, tensors)
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors)
    ready = torch.cuda.Event()
    ready.record()
    return PendingSample(ids, num_rows, logprobs, host, ready)


class Sampler:
    def __init__(self, vocab_size: int, end_ids: frozenset[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.end_ids = end_ids          # EOS and the model's extra stop ids
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self._shared = torch.Generator(device=device)
        self._shared.seed()

    def release(self, req_id: int) -> None:
        self._generators.pop(req_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        g = self._generators.get(seq.req_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seq.params.seed)
            if seq.status is not Status.FINISHED:   # (a row of a request aborted during the launch: dropped)
                self._generators[seq.req_id] = g
        return g

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits [S, V] fp32 (one row per sampled sequence, in `seqs` order) → one token per row."""
        return self.resolve(self.launch(logits, seqs))

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """Enqueues the choice of one token per row; nothing is read back (`resolve` does). The filters decide
        on host params, and index / parameter tensors go up by queued pinned copies (`to_device`), so no path
        waits on the device (no boolean-mask indexing either: it would read a count back)."""
        if all(map(_plain, seqs)):
            # Greedy, no penalties, no masks, no logprobs (a benchmark's or a greedy batch's usual step):
            # nothing writes the logits, so the argmax reads them without the fp32 copy.
            lg = logits[:, : self.vocab_size]
            if lg.dtype != torch.float32 and lg.device.type != "cpu":   # widening keeps the order: the
                lg = lg.float()                                          # CPU's max reads bf16 as it is
            return _staged(_argmax(lg), len(seqs))
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=True).contiguous()   # written in place
        guided = [i for i, s in enumerate(seqs) if s.guide is not None]
        if guided:                                   # every token that would leave a row's guide is masked
            idx = to_device(guided, logits.device)
            allowed = guide_masks([seqs[i].guide for i in guided], logits.shape[1], logits.device)
            logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        if restricted := [i for i, s in enumerate(seqs) if s.params.allowed_token_ids is not None]:
            self._allow_only(logits, [seqs[i].params.allowed_token_ids for i in restricted], restricted)
        want_lp = [s.params.logprobs for s in seqs]
        lp_rows = [i for i, n in enumerate(want_lp) if n is not None]
        # Raw logprobs, before the penalties write the logits (the row gather is a copy). A masked token's
        # logprob is -inf, which JSON cannot carry: floored at -9999 (as vLLM does), once the chosen tokens'
        # ranks are counted.
        logprobs = torch.log_softmax(logits[to_device(lp_rows, logits.device)], -1) if lp_rows else None
        self._penalize(logits, seqs)

        chosen = _argmax(logits)                       # [S]; greedy rows keep this
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            idx = to_device(rows, logits.device)
            probs = self._filtered_probs(logits[idx], [seqs[i] for i in rows])   # [R, V]
            noise = torch.empty_like(probs)
            shared = [j for j, i in enumerate(rows) if seqs[i].params.seed is None]
            if shared:
                sh = to_device(shared, logits.device)
                noise[sh] = noise[sh].exponential_(generator=self._shared)
            for j, i in enumerate(rows):
                if seqs[i].params.seed is not None:
                    noise[j].exponential_(generator=self._generator(seqs[i]))
            chosen[idx] = _argmax(probs / noise)
        if logprobs is None:
            return _staged(chosen, len(seqs))
        # Every logprob row at once: the chosen token's value and the top max(n), cut to each row's n.
        idx = to_device(lp_rows, logits.device)
        own = logprobs.gather(1, chosen[idx][:, None])[:, 0]     # [L]
        rank = (logprobs >= own[:, None]).sum(-1)                # counts the token itself (vLLM's rank)
        logprobs.clamp_min_(-9999.0)
        own.clamp_min_(-9999.0)
        k = max(want_lp[i] for i in lp_rows)
        top_v, top_i = torch.topk(logprobs, k, -1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        return _staged(chosen, len(seqs), (lp_rows, [want_lp[i] for i in lp_rows], own, top_v, top_i, rank))

    @staticmethod
    def _allow_only(logits: torch.Tensor, allowed: list[tuple[int, ...]], rows: list[int]) -> None:
        """Masks, in each of `rows`, every token outside its allowed ids (one flat fill for all the rows)."""
        v = logits.shape[1]
        keep = torch.zeros(len(rows), v, dtype=torch.bool, device=logits.device)    # [R, V]
        flat = [j * v + t for j, ids in enumerate(allowed) for t in ids]
        keep.view(-1).index_fill_(0, to_device(flat, logits.device), True)
        idx = to_device(rows, logits.device)
        logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))

    @staticmethod
    def resolve(p: PendingSample) -> SampleResult:
        """The chosen ids and logprobs, once their step's copies are done (the step's one wait on the device;
        it does not wait for work queued after them)."""
        if p.ready is not None:
            p.ready.synchronize()
        token_ids = p.host[0].tolist()
        out_lp: list[Logprob | None] = [None] * p.num_rows
        if p.logprobs is not None:
            rows, ns = p.logprobs[:2]
            own_l, top_vl, top_il, rank_l = (t.tolist() for t in p.host[1:])
            for j, (i, n) in enumerate(zip(rows, ns)):
                out_lp[i] = Logprob(token_ids[i], own_l[j], list(zip(top_il[j][:n], top_vl[j][:n])), rank_l[j])
        return SampleResult(token_ids, out_lp)

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        masked: dict[tuple[int, ...], list[int]] = {}     # end ids to mask → the rows that mask them
        bias_at: list[int] = []                           # flat positions of the rows' logit biases
        bias: list[float] = []
        for i, s in enumerate(seqs):
            if s.plain:
                continue
            p = s.params
            if p.repetition_penalty != 1.0:
                # the prompt's distinct ids are put on the device once; an id both there and in the output is
                # written twice with the same value (each is computed from the logits before the write)
                if s.penalty_prompt is None or s.penalty_prompt.device != logits.device:
                    s.penalty_prompt = to_device(sorted(set(s.prompt_ids)), logits.device)
                ids = s.penalty_prompt
                if s.output_ids:
                    ids = torch.cat([ids, to_device(s.output_ids, logits.device)])
                vals = logits[i, ids]
                logits[i, ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and s.output_ids:
                out = to_device(s.output_ids, logits.device)       # index_add_, not bincount: no read-back
                counts = logits.new_zeros(logits.shape[1]).index_add_(0, out, logits.new_ones(out.shape[0]))
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if p.logit_bias:
                row = i * logits.shape[1]
                for tid, b in p.logit_bias:
                    bias_at.append(row + tid)
                    bias.append(b)
            if len(s.output_ids) < p.min_new_tokens and s.guide is None:   # a guide decides where it ends
                ends = tuple(t for t in (*self.end_ids, *p.stop_token_ids) if t < logits.shape[1])
                if ends:
                    masked.setdefault(ends, []).append(i)
        if bias_at:                                       # one add for every row's biases, after the penalties
            logits.view(-1).index_add_(0, to_device(bias_at, logits.device),
                                       to_device(bias, logits.device, logits.dtype))
        for ends, rows in masked.items():                 # one write per distinct set, not one per row
            # index_fill_ of flat positions with a scalar: assigning a Python float through advanced
            # indexing copies it up as a tensor, which synchronizes
            flat = [i * logits.shape[1] + e for i in rows for e in ends]
            logits.view(-1).index_fill_(0, to_device(flat, logits.device), float("-inf"))

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p on [R, V] logits → probabilities [R, V]."""
        temps = to_device([s.params.temperature for s in seqs], logits.device)
        logits = logits / temps[:, None]
        top_k = [s.params.top_k for s in seqs]
        if any(top_k):
            # The k-th largest value through topk of the largest k, not a sort of the whole vocabulary; rows
            # without top-k get -inf, which masks nothing (as the smallest value did).
            v = logits.shape[1]
            ks = [min(k, v) for k in top_k]
            kth = torch.topk(logits, max(ks), -1).values.gather(
                1, to_device([max(k, 1) - 1 for k in ks], logits.device)[:, None])
            if not all(ks):
                kth = kth.masked_fill(to_device([k == 0 for k in ks], logits.device)[:, None], float("-inf"))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        if any(s.params.top_p < 1.0 for s in seqs):            # host checks: no device sync
            # Keep the smallest set with mass ≥ top_p, as transformers' TopPLogitsWarper and vLLM: drop the
            # least likely tokens whose cumulative mass (ascending) is ≤ 1 − top_p, never the most likely one.
            # A row with top_p = 1 drops only tokens of probability 0 (a descending cumsum could pass 1.0 by
            # rounding and cut its tail, so that a row's draws would depend on its batch).
            rest = to_device([1.0 - s.params.top_p for s in seqs], logits.device, torch.float32)
            sp, si = torch.sort(probs, -1)
            drop = sp.cumsum(-1) <= rest[:, None]
            drop[:, -1].fill_(False)                           # (1 − 1e-9 rounds to 1.0 in float32)
            probs = probs.scatter(1, si, sp.masked_fill(drop, 0.0))
        if any(s.params.min_p > 0 for s in seqs):
            min_p = to_device([s.params.min_p for s in seqs], logits.device)
            thresh = min_p[:, None] * probs.max(-1, keepdim=True).values
            probs = probs.masked_fill(probs < thresh, 0.0)
        return probs / probs.sum(-1, keepdim=True)
