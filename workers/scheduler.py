"""Continuous batching with a Dynamic SplitFuse token budget, and preemption by recompute.

No torch here: the scheduler works on Sequences (ints and lists) and hands the runner a StepPlan.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

from mii_async.config import SchedulerConfig

from .block_manager import BlockManager
from .sequence import Sequence, Status
from .step_plan import ScheduledSeq, StepPlan


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()   # FCFS; preempted sequences go back to the front
        self.running: list[Sequence] = []         # admission order: the last is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all_seqs(self) -> Iterator[Sequence]:
        yield from self.running
        yield from self.waiting

    def remove(self, seq: Sequence) -> None:
        """Ends `seq` (finished, aborted, failed): its blocks go back to the pool."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> StepPlan:
        """Builds the next step.

        One code path for prefill and decode: each sequence has `num_computed_tokens` of its `num_tokens`
        (prompt + output) in the KV cache, and a step computes the next chunk of the rest. A decode is the
        case where one token is left. Running decodes are scheduled first, one token each; the rest of the
        `max_batch_tokens` budget goes to prompt chunks of running sequences, then of waiting ones (FCFS).
        A sequence is sampled when its chunk reaches its last known token. When the pool runs out for a running
        sequence, the newest running sequence is preempted (blocks freed, requeued for recompute) until the
        older one fits; waiting sequences only take free blocks, so admission never evicts running work.
        """
        budget = self.config.max_batch_tokens
        chosen: dict[int, tuple[Sequence, int]] = {}   # id(seq) → (seq, tokens this step), insertion order
        preempted = 0
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while self.bm.blocks_needed(seq, n) > self.bm.num_free:
                victim = self.running[-1]
                if id(victim) in chosen:
                    budget += chosen.pop(id(victim))[1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.bm.append(seq, n)
                chosen[id(seq)] = (seq, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.bm.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.bm.max_appendable(seq))
            if n <= 0:
                self.bm.free(seq)               # give back prefix hits; retry when blocks free up
                seq.num_computed_tokens = seq.num_hashed_blocks = 0
                seq.last_block_hash = None
                break
            self.waiting.popleft()
            self.bm.append(seq, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen[id(seq)] = (seq, n)
            budget -= n
        self.num_preemptions += preempted
        return self._plan(list(chosen.values()), preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def _plan(self, chosen: list[tuple[Sequence, int]], preempted: int) -> StepPlan:
        chosen.sort(key=lambda sn: sn[1] != 1)   # stable: one-token entries first
        plan = StepPlan(num_preempted=preempted)
        for seq, n in chosen:
            start = seq.num_computed_tokens
            plan.seqs.append(ScheduledSeq(seq.req_id, seq.token_ids(start, start + n), start,
                                          list(seq.block_table), start + n == seq.num_tokens))
        plan.num_decodes = sum(1 for s in plan.seqs if len(s.token_ids) == 1)
        return plan

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """After the forward pass: `num_tokens` more of `seq` are in the cache."""
        seq.num_computed_tokens += num_tokens
        self.bm.register_full_blocks(seq)
