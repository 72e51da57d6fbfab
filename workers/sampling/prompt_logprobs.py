"""Prompt logprobs: each prompt token's logprob given the tokens before it, from the logits of the rows a step
scores (`ScheduledSeq.score_from` / `score_to`, planned by the scheduler), computed on the device when the step
is launched and read with its sampled ids as numpy chunks, packed once for the request's first token in the
form they travel in (protocol.PromptLogprobs): no Python object per position on the engine's loop."""
from __future__ import annotations

from typing import NamedTuple

import torch

from mii_async import protocol as P

from .sampler import to_device
from ..core.sequence import Sequence, Status
from ..core.step_plan import StepPlan


class PendingScores(NamedTuple):
    """A step's prompt logprobs, enqueued on the device. Their host copies are queued before the step's sampling,
    so the event the sampler records after its own copies covers them too."""
    spans: list[tuple[Sequence, int]]    # each scored sequence and its number of rows, in row order
    top_n: list[int]                     # each one's params.prompt_logprobs
    host: tuple                          # own [E], top values [E, k], top ids [E, k], ranks [E] (pinned copies on
                                         # a GPU)


def launch_scores(plan: StepPlan, seqs: list[Sequence], logits: torch.Tensor) -> PendingScores:
    """`logits` [plan.num_scored, V] fp32: the scored rows, in plan order; `seqs`: the plan's sequences, in
    plan order. Row r of a chunk scores the prompt token after it: its own logprob, its rank in the row (1 +
    the tokens more likely, and those as likely, as vLLM counts), and the top n of the row."""
    spans, top_n, targets = [], [], []
    for s, seq in zip(plan.seqs, seqs):
        if s.score_to > s.score_from:
            spans.append((seq, s.score_to - s.score_from))
            top_n.append(seq.params.prompt_logprobs)
            targets += seq.prompt_ids[s.start_pos + s.score_from + 1:s.start_pos + s.score_to + 1]
    lp = torch.log_softmax(logits.float(), -1)
    own = lp.gather(1, to_device(targets, lp.device)[:, None])[:, 0]
    rank = (lp >= own[:, None]).sum(-1)            # counts the token itself (before the clamp, which ties)
    lp.clamp_min_(-9999.0)                         # JSON carries no -inf
    own.clamp_min_(-9999.0)
    k = max(top_n)
    top_v, top_i = torch.topk(lp, k, -1) if k else (lp[:, :0], lp[:, :0].long())
    host = (own, top_v, top_i, rank)
    if lp.device.type == "cuda":
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in host)
    return PendingScores(spans, top_n, host)


def read_scores(p: PendingScores) -> None:
    """Appends each scored sequence's rows to its `prompt_lps` as one chunk of little-endian arrays (own [count]
    float32, top ids [count, n] uint32, top logprobs [count, n] float32, ranks [count] uint32), once the step's
    sampled ids have been read (which waits for these copies too). A sequence ended since the launch is left
    alone."""
    own, top_v, top_i, rank = (t.numpy() for t in p.host)     # host tensors: views, no copy
    row = 0
    for (seq, count), n in zip(p.spans, p.top_n):
        if seq.status is not Status.FINISHED:
            end = row + count
            seq.prompt_lps.append((own[row:end].astype("<f4"),      # type: ignore[union-attr]
                                   top_i[row:end, :n].astype("<u4"), top_v[row:end, :n].astype("<f4"),
                                   rank[row:end].astype("<u4")))
        row += count


def packed(seq: Sequence) -> P.PromptLogprobs:
    """The sequence's prompt logprobs as they travel (every position scored: its first token was just read);
    its chunks are dropped, nothing reads them again."""
    chunks = seq.prompt_lps
    assert chunks is not None and sum(len(c[0]) for c in chunks) == len(seq.prompt_ids) - 1, \
        "prompt logprobs are packed once every prompt position is scored"
    out = P.PromptLogprobs(seq.params.prompt_logprobs or 0, *(b"".join(c[i] for c in chunks) for i in range(4)))
    chunks.clear()
    return out
