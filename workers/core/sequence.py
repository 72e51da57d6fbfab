"""Sequence: one request's state inside the engine. Plain ints and lists; no torch."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from mii_async.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and requeued for recompute
    RUNNING = "running"      # holds KV blocks, scheduled every step
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    req_id: int                          # the caller's id, unique while the request lives
    prompt_ids: list[int]                # the prompt, fixed
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)   # sampled tokens, in order
    num_computed_tokens: int = 0         # tokens whose K/V are in the cache (reset to 0 on preemption)
    block_table: list[int] = field(default_factory=list)  # KV block ids, in token order
    num_hashed_blocks: int = 0           # leading full blocks registered in the prefix cache
    last_block_hash: bytes | None = None  # chained digest of block num_hashed_blocks - 1
    status: Status = Status.WAITING
    num_cached_prompt_tokens: int = 0    # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    # Async scheduling: the last `num_pending` output ids are placeholders for tokens a step still in flight
    # samples (−1 − r: the r-th id that step samples, on the device); the engine writes them in when it reads
    # that step's ids. Prefix hashing and admission wait for them.
    num_pending: int = 0
    max_tokens: int = 0                  # prompt + output at which the request ends by length (0: prompt +
                                         # max_new_tokens; the engine caps it by the context)
    # True when the argmax of the raw logits is all this request ever needs (greedy, no penalties, no logit
    # bias, no guide, no min_new_tokens mask, no logprobs): the sampler takes one batched argmax when every row
    # is plain. Derived from the frozen params once, so the per-step check is one attribute read.
    plain: bool = field(init=False)
    # True when sampling never reads the output so far (no repetition / presence / frequency penalty, no
    # guide): a step may then be sampled while this request's previous token is still a placeholder.
    history_free: bool = field(init=False)
    guide: Any = None                    # guided generation: its RequestGuide (workers/sampling/guides.py), set at
                                         # admission, advanced by each token read
    penalty_prompt: Any = None           # repetition penalty: the prompt's distinct ids on the sampler's device,
                                         # made at its first sampled step (not a set of a long prompt each step)
    # Prompt logprobs (params.prompt_logprobs): the scored positions' values as numpy chunks (own, top ids, top
    # logprobs; workers/sampling/prompt_logprobs.py), appended in position order as steps are read and packed (then
    # dropped) for the first token; `num_scored` prompt positions have been planned (position p gives token
    # p + 1's).
    prompt_lps: list | None = field(init=False)
    num_scored: int = 0
    arrival: int = 0                     # the engine's count of requests added before this one: the waiting
                                         # queue's order (a guided request joins it late, at its place)

    def __post_init__(self) -> None:
        p = self.params
        self.history_free = (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                             and p.guide is None)     # a guide's next mask follows the last token
        self.plain = (p.greedy and p.logprobs is None and p.min_new_tokens == 0 and self.history_free
                      and not p.logit_bias and p.allowed_token_ids is None)
        self.prompt_lps = [] if p.prompt_logprobs is not None else None
        if not self.max_tokens:
            self.max_tokens = len(self.prompt_ids) + p.max_new_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def scoring(self) -> bool:
        """Whether prompt positions whose logprobs are asked for are still to be computed."""
        return self.prompt_lps is not None and self.num_scored < len(self.prompt_ids) - 1

    def reset_for_recompute(self) -> None:
        """After preemption: the blocks are gone; prompt + output so far will be prefilled again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_hashed_blocks = 0
        self.last_block_hash = None
        self.status = Status.WAITING
        self.num_preemptions += 1
