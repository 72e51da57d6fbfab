"""StepPlan: what the scheduler hands the runner for one forward pass. Plain ints and lists."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)          # slots: a step builds one per scheduled sequence, hundreds per step
class ScheduledSeq:
    req_id: int
    token_ids: list[int]        # the tokens computed this step (a prompt chunk, or the last sampled token)
    start_pos: int              # position of token_ids[0] == num_computed_tokens before the step
    block_table: list[int]      # the sequence's whole block table (covers start_pos + len(token_ids)); a copy
    sample: bool                # True when this chunk ends at the last known token: sample the next one
    score_from: int = 0         # prompt logprobs: the chunk's rows [score_from, score_to) (offsets in token_ids)
    score_to: int = 0           # give the logprobs of the prompt tokens after them


@dataclass(slots=True)
class StepPlan:
    seqs: list[ScheduledSeq] = field(default_factory=list)  # one-token entries first (the decodes)
    num_decodes: int = 0        # leading entries with exactly one token
    num_preempted: int = 0      # sequences preempted while building this plan (for stats)
    num_scored: int = 0         # rows scored for prompt logprobs, over all entries

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)
