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
