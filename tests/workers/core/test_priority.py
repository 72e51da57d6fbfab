"""The scheduler's waiting order: priority (lower first), then arrival (vLLM's `priority`)."""
from __future__ import annotations

from mii_async.config import SchedulerConfig
from mii_async.params import SamplingParams
from mii_async.workers.core.block_manager import BlockManager
from mii_async.workers.core.scheduler import Scheduler
from mii_async.workers.core.sequence import Sequence


def _admitted_order(priorities: list[int]) -> list[int]:
    """Adds one request per priority (ids in arrival order) to a scheduler that runs one sequence at a time,
    and returns the ids in the order they are admitted."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_batch_tokens=64, max_num_seqs=1).resolved("cpu"), bm)
    seqs = {}
    for i, p in enumerate(priorities):
        seqs[i] = Sequence(i, [1, 2, 3], SamplingParams(max_new_tokens=1, priority=p), arrival=i)
        sched.add(seqs[i])
    order = []
    while sched.has_work():
        sched.schedule()
        [seq] = sched.running                     # one at a time: the one admitted
        order.append(seq.req_id)
        sched.remove(seq)                         # it ends; the next is admitted at the next step
    return order


def test_waiting_requests_run_by_priority_then_arrival():
    assert _admitted_order([0, 5, -1, 0, 5]) == [2, 0, 3, 1, 4]


def test_equal_priorities_keep_arrival_order():
    assert _admitted_order([0, 0, 0, 0]) == [0, 1, 2, 3]



def _run(sched: Scheduler) -> list[tuple[int, int]]:
    """One step: scheduled, then committed as the runner would (a token sampled for each chunk that reached its
    sequence's end); returns its (request id, tokens) in plan order."""
    plan = sched.schedule()
    for s in plan.seqs:
        seq = next(r for r in sched.running if r.req_id == s.req_id)
        sched.commit(seq, len(s.token_ids))
        if s.sample:
            seq.output_ids.append(7)
    return [(s.req_id, len(s.token_ids)) for s in plan.seqs]


def _scheduler(max_num_seqs: int, *background: int) -> Scheduler:
    """A scheduler with one background request (priority 1, 3 prompt tokens) per id given, brought to decoding."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_batch_tokens=64, max_num_seqs=max_num_seqs).resolved("cpu"), bm)
    for i in background:
        sched.add(Sequence(i, [1, 2, 3], SamplingParams(max_new_tokens=50, priority=1), arrival=i))
    assert _run(sched) == [(i, 3) for i in background]
    return sched


def test_a_due_interactive_prompt_has_the_step_to_itself():
    """Two background requests (priority 1) decoding; an interactive one (priority 0) arrives with another
    background one: the step that computes the interactive prompt carries nothing else; the next decodes all
    three and admits the background prompt."""
    sched = _scheduler(8, 1, 2)
    assert _run(sched) == [(1, 1), (2, 1)]         # background decodes while nothing else is due
    sched.add(Sequence(3, [4, 5, 6, 7, 8], SamplingParams(max_new_tokens=5, priority=1), arrival=3))
    sched.add(Sequence(4, [4, 5, 6, 7, 8, 9], SamplingParams(max_new_tokens=5), arrival=4))
    assert _run(sched) == [(4, 6)]
    assert sorted(_run(sched)) == [(1, 1), (2, 1), (3, 5), (4, 1)]


def test_background_prompts_run_beside_background_decodes():
    """With no better priority due, background prompts and decodes share steps as any others do."""
    sched = _scheduler(8, 1)
    sched.add(Sequence(2, [4, 5, 6, 7], SamplingParams(max_new_tokens=5, priority=1), arrival=2))
    assert _run(sched) == [(1, 1), (2, 4)]


def test_an_interactive_prompt_that_cannot_be_admitted_holds_nothing_back():
    """The interactive request finds every sequence slot taken: background decodes go on (holding them back
    would keep the slot it waits for from ever freeing)."""
    sched = _scheduler(2, 1, 2)
    sched.add(Sequence(3, [4, 5, 6], SamplingParams(max_new_tokens=5), arrival=3))
    assert _run(sched) == [(1, 1), (2, 1)]


def test_a_large_priority_number_is_admitted_beside_decodes():
    """A request of priority 1000 (more than the step's token budget) waits only for better priorities: beside a
    running decode of the same priority it is admitted at once."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_batch_tokens=64, max_num_seqs=8).resolved("cpu"), bm)
    sched.add(Sequence(1, [1, 2, 3], SamplingParams(max_new_tokens=50, priority=1000), arrival=1))
    assert _run(sched) == [(1, 3)]
    sched.add(Sequence(2, [4, 5, 6, 7], SamplingParams(max_new_tokens=5, priority=1000), arrival=2))
    assert _run(sched) == [(1, 1), (2, 4)]


def test_a_due_interactive_prompt_keeps_background_out_beside_interactive_decodes():
    """An interactive request decoding, a background one decoding; a new interactive prompt and a background
    prompt arrive: the step holds the interactive decode and prompt only."""
    sched = _scheduler(8, 1)
    sched.add(Sequence(2, [1, 2, 3], SamplingParams(max_new_tokens=50), arrival=2))
    assert _run(sched) == [(2, 3)]                          # its prompt alone
    assert sorted(_run(sched)) == [(1, 1), (2, 1)]
    sched.add(Sequence(3, [4, 5, 6, 7, 8], SamplingParams(max_new_tokens=5, priority=1), arrival=3))
    sched.add(Sequence(4, [4, 5, 6, 7, 8, 9], SamplingParams(max_new_tokens=5), arrival=4))
    assert sorted(_run(sched)) == [(2, 1), (4, 6)]
