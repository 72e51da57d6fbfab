"""Sampler: logits processing and token choice for one step's sampled rows.

Order (HF's, then vLLM's): repetition penalty over prompt + output → presence/frequency penalties over the
output → min_new_tokens masks the end ids → logprobs are taken here, of the processed-by-penalties logits
before temperature → temperature, top-k, top-p, min-p → choice. Greedy rows take the argmax.

Random choice is the exponential race (argmax p_i / E_i with E_i ~ Exp(1)), which equals sampling from p.
A request with a `seed` owns a torch.Generator, so its draws never depend on what else is in the batch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .sequence import Sequence


class TokenLogprobs(NamedTuple):
    logprob: float                       # of the chosen token
    top: list[tuple[int, float]]         # the n most likely (id, logprob), best first


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


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
            self._generators[seq.req_id] = g
        return g

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits [S, V] fp32 (one row per sampled sequence, in `seqs` order) → one token per row."""
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=True)   # penalties write in place
        self._penalize(logits, seqs)
        want_lp = [s.params.logprobs for s in seqs]
        logprobs = torch.log_softmax(logits, -1) if any(n is not None for n in want_lp) else None

        chosen = torch.argmax(logits, -1)                       # [S]; greedy rows keep this
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            probs = self._filtered_probs(logits[idx], [seqs[i] for i in rows])   # [R, V]
            noise = torch.empty_like(probs)
            shared = [j for j, i in enumerate(rows) if seqs[i].params.seed is None]
            if shared:
                noise[shared] = noise[shared].exponential_(generator=self._shared)
            for j, i in enumerate(rows):
                if seqs[i].params.seed is not None:
                    noise[j].exponential_(generator=self._generator(seqs[i]))
            chosen[idx] = torch.argmax(probs / noise, -1)

        token_ids = chosen.tolist()
        out_lp: list[TokenLogprobs | None] = [None] * len(seqs)
        if logprobs is not None:
            for i, n in enumerate(want_lp):
                if n is None:
                    continue
                top_v, top_i = torch.topk(logprobs[i], n) if n else (logprobs[i][:0], logprobs[i][:0].long())
                out_lp[i] = TokenLogprobs(float(logprobs[i, token_ids[i]]),
                                          list(zip(top_i.tolist(), top_v.tolist())))
        return SampleResult(token_ids, out_lp)

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, s in enumerate(seqs):
            p = s.params
            if p.repetition_penalty != 1.0:
                ids = torch.tensor(sorted(set(s.prompt_ids) | set(s.output_ids)), device=logits.device)
                vals = logits[i, ids]
                logits[i, ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and s.output_ids:
                counts = torch.bincount(torch.tensor(s.output_ids, device=logits.device),
                                        minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if len(s.output_ids) < p.min_new_tokens:
                ends = [t for t in (*self.end_ids, *p.stop_token_ids) if t < logits.shape[1]]
                if ends:
                    logits[i, ends] = float("-inf")

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p on [R, V] logits → probabilities [R, V]."""
        temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        logits = logits / temps[:, None]
        top_k = [s.params.top_k for s in seqs]
        if any(top_k):
            ks = torch.tensor([k if k else logits.shape[1] for k in top_k], device=logits.device)
            kth = torch.sort(logits, -1, descending=True).values.gather(1, (ks.clamp(max=logits.shape[1]) - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=logits.device)
        if bool((top_p < 1.0).any()):
            sp, si = torch.sort(probs, -1, descending=True)
            drop = (sp.cumsum(-1) - sp) > top_p[:, None]       # keep the smallest set with mass ≥ top_p
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, si, sp)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=logits.device)
        if bool((min_p > 0).any()):
            thresh = min_p[:, None] * probs.max(-1, keepdim=True).values
            probs = probs.masked_fill(probs < thresh, 0.0)
        return probs / probs.sum(-1, keepdim=True)
