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


ADMISSION_WATERMARK = 0.01   # the share of the pool that admission leaves free while others run (vLLM's 1%)
MAX_SCORED_ROWS = 512   # prompt positions scored for prompt logprobs per step: their fp32 logits rows (and
                        # log-softmax) are [rows, V], 0.26 GB each at a 128k vocabulary


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()   # by priority, then arrival; preempted ones go back to the front
        self.running: list[Sequence] = []         # admission order: the last is the newest
        self.num_preemptions = 0
        # Blocks a new request's chunk leaves free when others run: the running decodes' next blocks, which
        # would otherwise preempt the newcomer at once (its blocks freed, its prompt computed again).
        self.watermark_blocks = int(block_manager.num_blocks * ADMISSION_WATERMARK)
        self._scheduled: list[tuple[Sequence, int]] = []   # the last plan's (seq, tokens), in plan order
        self._cut: set[int] = set()               # id(seq) of the chunk the last plan cut (step_token_multiple)

    def add(self, seq: Sequence) -> None:
        """Queues `seq` by its priority (lower first), then in arrival order: behind every waiting sequence of
        its priority that arrived before it, and of a lower priority number. A request that joins late (a
        guided one, once its automaton is compiled) goes ahead of those of its priority that arrived after it;
        the others join at the back of their priority."""
        waiting = self.waiting
        key = (seq.params.priority, seq.arrival)
        i = len(waiting)
        while i and (waiting[i - 1].params.priority, waiting[i - 1].arrival) > key:
            i -= 1
        waiting.insert(i, seq)

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

    def remove_many(self, seqs: list[Sequence]) -> None:
        """`remove` of each of `seqs`, in order (the free list's order depends on it), with one pass over
        `running` instead of one `list.remove` per sequence: a step may finish hundreds at once."""
        gone: set[int] = set()
        for seq in seqs:
            if seq.status is Status.RUNNING:
                gone.add(id(seq))
            elif seq.status is Status.WAITING:
                self.waiting.remove(seq)
            self.bm.free(seq)
            seq.status = Status.FINISHED
        if gone:
            self.running[:] = [s for s in self.running if id(s) not in gone]

    def schedule(self) -> StepPlan:
        """Builds the next step.

        One code path for prefill and decode: each sequence has `num_computed_tokens` of its `num_tokens`
        (prompt + output) in the KV cache, and a step computes the next chunk of the rest. A decode is the
        case where one token is left. Running decodes are scheduled first, one token each; the rest of the
        `max_batch_tokens` budget (`max_mixed_batch_tokens` when there are decodes: a latency bound) goes to
        prompt chunks of running sequences, then of waiting ones (FCFS).
        A sequence is sampled when its chunk reaches its last known token. When the pool runs out for a running
        sequence, the newest running sequence is preempted (blocks freed, requeued for recompute) until the
        older one fits; the newest itself takes what fits, or waits. Waiting sequences only take free blocks, and
        leave `watermark_blocks` of them while others run, so admission never evicts running work; a step that
        preempts admits none. Where a prompt of a better priority than some running sequence's is due (a chat
        beside a batch's lines), the step carries only work of that priority or better.
        """
        budget = self.config.max_batch_tokens
        bm, bs = self.bm, self.bm.block_size
        decodes: list[Sequence] = []
        needs: list[int] = []                          # new blocks each decode needs (0 or 1)
        prefills: list[Sequence] = []
        worst = None                                   # the largest priority number among running sequences
        for s in self.running:
            total = len(s.prompt_ids) + len(s.output_ids)
            left = total - s.num_computed_tokens
            if worst is None or s.params.priority > worst:
                worst = s.params.priority
            if left == 1:
                if s.num_pending and total >= s.max_tokens:
                    continue                           # its pending token is its last: it ends when read
                decodes.append(s)
                needs.append(max(0, -(-(s.num_computed_tokens + 1) // bs) - len(s.block_table)))
            elif left > 1:
                prefills.append(s)
        only = None                                    # with a prompt of a better priority due: that priority
        if worst is not None and (lead := self._lead_prompt(prefills)) is not None and lead < worst:
            only = lead
            # A prompt of a better priority is due: this step is its alone, with the decodes and prompt chunks
            # of that priority or better (background work waits one step instead of lengthening the step the
            # interactive request's first token waits for).
            kept = [i for i, s in enumerate(decodes) if s.params.priority <= lead]
            decodes, needs = [decodes[i] for i in kept], [needs[i] for i in kept]
            prefills = [s for s in prefills if s.params.priority <= lead]
        if decodes and (cap := self.config.max_mixed_batch_tokens):
            # A step with decodes sets every running stream's inter-token gap: the prompt chunks beside them
            # stop at the mixed budget; the decodes themselves are never held back by it.
            budget = min(budget, max(cap, len(decodes)))
        preempted = 0
        score_left = MAX_SCORED_ROWS
        # id(seq) → (seq, tokens this step), insertion order
        chosen: dict[int, tuple[Sequence, int]]
        new_blocks = sum(needs)
        if len(decodes) <= budget and new_blocks <= bm.num_free:
            # The common case: every decode fits, so the general loop below would take them all, in this
            # order, without preempting. Their new blocks come from one `take`, in the same order.
            if new_blocks:
                fresh = iter(bm.take(new_blocks))
                for s, need in zip(decodes, needs):
                    for _ in range(need):
                        s.block_table.append(next(fresh))
            chosen = {id(s): (s, 1) for s in decodes}
            budget -= len(decodes)
            queue = prefills
        else:
            chosen = {}
            queue = decodes + prefills
        for seq in queue:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.scoring:
                n, used = _cap_scored(seq, n, score_left)
                if n == 0:
                    continue
                score_left -= used
            while bm.blocks_needed(seq, n) > bm.num_free:
                victim = self.running[-1]
                if victim is seq:
                    # The newest has no one newer to take blocks from. Preempted, it would go to the front of
                    # the queue and be readmitted (this step) on the same free blocks, its K/V computed again
                    # from position 0: it takes what fits, or waits holding its blocks until an older
                    # request ends or preempts it (the oldest always fits: no request outgrows the pool).
                    n = min(n, bm.max_appendable(seq))
                    break
                if id(victim) in chosen:
                    budget += chosen.pop(id(victim))[1]
                self._preempt(victim)
                preempted += 1
            if n > 0:
                bm.append(seq, n)
                chosen[id(seq)] = (seq, n)
                budget -= n
        # A step that preempted admits no one: the preempted sequence, at the queue's head, would be readmitted
        # at once on the blocks it just gave up, and preempted again by the same growth (vLLM does the same).
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break                           # preempted with a token in flight: next step, once it is read
            if only is not None and seq.params.priority > only:
                break
            if matched := not seq.block_table:
                bm.match_prefix(seq)
            room = bm.max_appendable(seq) - (self.watermark_blocks * bs if self.running else 0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, room)
            if n > 0 and seq.scoring:
                n, used = _cap_scored(seq, n, score_left)
                score_left -= used
            if n <= 0:
                bm.free(seq)                    # give back prefix hits; retry when blocks free up
                seq.num_computed_tokens = seq.num_hashed_blocks = 0
                seq.last_block_hash = None
                break
            self.waiting.popleft()
            if matched:
                bm.admitted(seq)                # before append: computed tokens are still the prefix hit
            bm.append(seq, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen[id(seq)] = (seq, n)
            budget -= n
        if (m := self.config.step_token_multiple) and m > 1:
            self._align(chosen, m)
        self.num_preemptions += preempted
        return self._plan(list(chosen.values()), preempted)

    def _lead_prompt(self, prefills: list[Sequence]) -> int | None:
        """The best priority among prompts due now: running sequences with prompt tokens left, and the head of
        the waiting queue where it could be admitted this step (a free sequence slot, free blocks beyond the
        admission watermark); None when there is none."""
        lead = min((s.params.priority for s in prefills), default=None)
        if (self.waiting and len(self.running) < self.config.max_num_seqs and not self.waiting[0].num_pending
                and self.bm.num_free > self.watermark_blocks):
            head = self.waiting[0].params.priority
            lead = head if lead is None else min(lead, head)
        return lead

    def _align(self, chosen: dict[int, tuple[Sequence, int]], m: int) -> None:
        """Cuts the step to a multiple of `m` tokens: the newest prompt chunk that keeps at least 2 tokens gives
        up the rest (its blocks for them go back), and computes it in the next step, which takes running
        prompts first. A GEMM along tokens costs whole tiles, so the cut tokens would have cost a partial tile
        of their own; in the next step they fill part of one that is paid for anyway.
        - A sequence cut in the previous step is not cut again: its rest would otherwise move a few tokens a
          step whenever the decodes alone leave a remainder just under m.
        - A cut chunk keeps 2 tokens, so it never becomes a one-token row: a plan's one-token rows come first,
          and a decode graph returns their logits in row order, each a sampled row's.
        - The blocks given back were just taken; a cached prefix that `take` evicted for them stays forgotten."""
        was_cut, self._cut = self._cut, set()
        r = sum(n for _, n in chosen.values()) % m
        if not r:
            return
        for key in reversed(chosen):
            seq, n = chosen[key]
            if n - r >= 2 and key not in was_cut:
                chosen[key] = (seq, n - r)
                self.bm.shrink(seq, n - r)
                self._cut.add(key)
                return

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def _plan(self, chosen: list[tuple[Sequence, int]], preempted: int) -> StepPlan:
        # One-token entries first, each group in chosen order (what a stable sort on n != 1 gives).
        ones = [sn for sn in chosen if sn[1] == 1]
        if len(ones) < len(chosen):
            chosen = ones + [sn for sn in chosen if sn[1] != 1]
        self._scheduled = chosen
        seqs = []
        add = seqs.append
        scored = 0
        for seq, n in chosen:
            start = seq.num_computed_tokens
            end = start + n
            entry = ScheduledSeq(seq.req_id, seq.token_ids(start, end), start, seq.block_table.copy(),
                                 end == seq.num_tokens)
            if seq.prompt_lps is not None:             # prompt logprobs: positions not planned before, up
                first = max(start, seq.num_scored)     # to the prompt's last but one
                top = min(end, len(seq.prompt_ids) - 1)
                if top > first:
                    entry.score_from, entry.score_to = first - start, top - start
                    seq.num_scored = top
                    scored += top - first
            add(entry)
        return StepPlan(seqs, len(ones), preempted, scored)

    def planned(self) -> list[Sequence]:
        """The sequences of the last plan's entries, in plan order."""
        return [seq for seq, _ in self._scheduled]

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """After the forward pass: `num_tokens` more of `seq` are in the cache."""
        seq.num_computed_tokens += num_tokens
        self.bm.register_full_blocks(seq)

    def commit_step(self) -> list[Sequence]:
        """After the forward pass of the last `schedule()`: `commit` of every chunk, in plan order; returns the
        sequences of the sampled rows (those whose chunk reached their last token), in plan order. One ended
        since the plan (aborted while the forward was launched) keeps its row and commits nothing: its
        blocks are back in the pool."""
        sampled = []
        for seq, n in self._scheduled:
            if seq.num_computed_tokens + n == seq.num_tokens:
                sampled.append(seq)
            if seq.status is not Status.FINISHED:
                self.commit(seq, n)
        self._scheduled = []
        return sampled


def _cap_scored(seq: Sequence, n: int, score_left: int) -> tuple[int, int]:
    """A chunk of `n` tokens of a sequence whose prompt positions are being scored, cut so that it scores at
    most `score_left` positions (those from num_scored up to the prompt's last but one); returns the chunk's
    length and the positions it scores. Positions scored before (a recompute after preemption) cost nothing."""
    start = seq.num_computed_tokens
    first = max(start, seq.num_scored)
    used = min(start + n, len(seq.prompt_ids) - 1) - first
    if used <= score_left:
        return n, max(used, 0)
    return first + score_left - start, score_left
