"""Block manager and scheduler invariants, as property tests (no model: sampled ids are made up)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mii_async.config import SchedulerConfig
from mii_async.params import SamplingParams
from mii_async.workers.core.block_manager import BlockManager
from mii_async.workers.core.scheduler import Scheduler
from mii_async.workers.core.sequence import Sequence

# Prompts from a tiny alphabet with shared prefixes, so the prefix cache is hit often.
prompt = st.lists(st.integers(0, 2), min_size=1, max_size=40)
request = st.tuples(prompt, st.integers(1, 12), st.booleans())   # (prompt, max_new_tokens, abort it midway)


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(request, min_size=1, max_size=12), num_blocks=st.integers(7, 40),
       block_size=st.sampled_from([1, 2, 4, 8]), budget=st.integers(1, 64), max_seqs=st.integers(1, 8),
       caching=st.booleans(), mixed=st.none() | st.integers(1, 64), multiple=st.none() | st.integers(1, 16),
       watermark=st.integers(0, 3))
def test_scheduler_never_loses_blocks(requests, num_blocks, block_size, budget, max_seqs, caching, mixed, multiple,
                                      watermark):
    """Random workloads through the scheduler: no block owned twice, refs exact, all finish, all free at idle;
    a step with decodes stays within the mixed budget (or its decodes); with a step token multiple, a step is
    a multiple of it unless none of its chunks could give up the rest; admission's watermark never deadlocks
    (a request may still grow into the whole pool)."""
    bm = BlockManager(num_blocks, block_size, caching)
    max_seqs = min(max_seqs, budget)                  # a config allows no more running than a step decodes
    config = SchedulerConfig(max_batch_tokens=budget, max_num_seqs=max_seqs, max_mixed_batch_tokens=mixed,
                             step_token_multiple=multiple)
    sched = Scheduler(config.resolved("cpu"), bm)
    sched.watermark_blocks = watermark
    cap = min(mixed or budget, budget)
    live: dict[int, Sequence] = {}
    for i, (p, n, _) in enumerate(requests):
        if len(p) + n <= num_blocks * block_size:     # the engine rejects the rest up front
            live[i] = Sequence(i, p, SamplingParams(max_new_tokens=n))
            sched.add(live[i])
    finished = set()
    for step in range(5000):
        if not sched.has_work():
            break
        decodes = sum(1 for s in sched.running if s.num_tokens - s.num_computed_tokens == 1)
        cut_before = {i for i, s in live.items() if id(s) in sched._cut}
        plan = sched.schedule()
        assert plan, "work left but nothing scheduled: a deadlock"
        assert plan.num_tokens <= (min(budget, max(cap, decodes)) if decodes else budget)
        assert len(sched.running) <= max_seqs
        if multiple:        # not a multiple only where no chunk could be cut (keeping 2, not cut just before)
            r = plan.num_tokens % multiple
            assert r == 0 or all(len(s.token_ids) - r < 2 or s.req_id in cut_before for s in plan.seqs)
        # One-token rows lead the plan; the sampled ones come first (a graph's logits are taken in row order).
        flags = [s.sample for s in plan.seqs[:plan.num_decodes]]
        assert flags == sorted(flags, reverse=True), flags
        bm.check_invariants(sched.all_seqs())
        for s in plan.seqs:
            seq = live[s.req_id]
            assert s.token_ids == seq.token_ids(s.start_pos, s.start_pos + len(s.token_ids))
            sched.commit(seq, len(s.token_ids))
            if s.sample:
                seq.output_ids.append((seq.num_tokens * 7) % 3)        # deterministic fake token
                aborted = requests[s.req_id][2] and len(seq.output_ids) == 1
                if aborted or len(seq.output_ids) >= seq.params.max_new_tokens:
                    sched.remove(seq)
                    finished.add(s.req_id)
        bm.check_invariants(sched.all_seqs())
    assert finished == set(live), "a request was dropped or never finished"
    assert bm.num_free == num_blocks


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(prompt, min_size=1, max_size=6), block_size=st.sampled_from([1, 2, 4]))
def test_prefix_hits_hold_the_same_tokens(prompts, block_size):
    """Blocks taken from the prefix cache hold exactly the tokens of the new request's prefix."""
    bm = BlockManager(64, block_size)
    owner_tokens: dict[int, tuple[int, ...]] = {}
    for i, p in enumerate(prompts):
        seq = Sequence(i, p, SamplingParams(max_new_tokens=1))
        bm.match_prefix(seq)
        hits = len(seq.block_table)
        for j, b in enumerate(seq.block_table):
            assert owner_tokens[b] == tuple(p[j * block_size:(j + 1) * block_size])
        n = seq.num_tokens - seq.num_computed_tokens
        bm.append(seq, n)
        seq.num_computed_tokens += n
        bm.register_full_blocks(seq)
        for j in range(hits, len(p) // block_size):   # freshly written blocks (maybe evicted and reused)
            owner_tokens[seq.block_table[j]] = tuple(p[j * block_size:(j + 1) * block_size])
        bm.free(seq)
        bm.check_invariants([])
    assert bm.num_free == 64


def _sched_with_decodes(n: int, multiple: int) -> tuple[Scheduler, BlockManager, dict[int, Sequence]]:
    """A scheduler whose `n` running sequences (3-token prompts, computed) each have one token to decode."""
    bm = BlockManager(64, 4)
    config = SchedulerConfig(max_batch_tokens=64, max_num_seqs=16, step_token_multiple=multiple)
    sched = Scheduler(config.resolved("cpu"), bm)
    seqs = {i: Sequence(i, [1, 2, 3], SamplingParams(max_new_tokens=50)) for i in range(n)}
    for s in seqs.values():
        sched.add(s)
    _run_plan(sched, sched.schedule(), seqs)   # 3n prompt tokens: no chunk of 3 can keep 2 and give up more
    return sched, bm, seqs


def _run_plan(sched: Scheduler, plan, seqs: dict[int, Sequence]) -> None:
    for s in plan.seqs:
        sched.commit(seqs[s.req_id], len(s.token_ids))
        if s.sample:
            seqs[s.req_id].output_ids.append(7)


def test_a_cut_prompt_is_not_cut_again():
    """step_token_multiple=8 with 6 decodes running: a 30-token prompt is cut once (to 26, a 32-token step),
    and its 4-token rest goes whole into the next step, not 2 tokens a step."""
    sched, bm, seqs = _sched_with_decodes(6, 8)
    seqs[99] = Sequence(99, list(range(30)), SamplingParams(max_new_tokens=4))
    sched.add(seqs[99])
    chunks = []
    for _ in range(2):
        plan = sched.schedule()
        assert plan.num_decodes == 6
        [chunk] = [s for s in plan.seqs if s.req_id == 99]
        chunks.append((plan.num_tokens, len(chunk.token_ids), chunk.sample))
        _run_plan(sched, plan, seqs)
    assert chunks == [(32, 26, False), (10, 4, True)]
    bm.check_invariants(sched.all_seqs())


def test_a_cut_never_leaves_a_one_token_row():
    """6 decodes, a running prompt with 7 tokens left and a new 1-token prompt, multiple 8 (14 tokens): the
    running chunk is not cut to one unsampled token ahead of the new prompt's sampled one (a decode graph hands
    out logits in row order)."""
    sched, bm, seqs = _sched_with_decodes(6, 8)
    seqs[50] = Sequence(50, list(range(10, 75)), SamplingParams(max_new_tokens=4))
    sched.add(seqs[50])
    plan = sched.schedule()                      # 6 decodes + 58 of the 65 prompt tokens: the 64-token budget
    assert plan.num_tokens == 64
    _run_plan(sched, plan, seqs)
    seqs[51] = Sequence(51, [5], SamplingParams(max_new_tokens=4))
    sched.add(seqs[51])
    plan = sched.schedule()
    flags = [s.sample for s in plan.seqs[:plan.num_decodes]]
    assert flags == sorted(flags, reverse=True) and plan.num_tokens == 6 + 7 + 1, (flags, plan.num_tokens)
    bm.check_invariants(sched.all_seqs())


def test_a_late_request_waits_at_its_arrival_place():
    """A request that joins the queue late (a guided one, once compiled) is admitted ahead of those that arrived
    after it, behind those that arrived before; with one sequence at a time the order is the arrival order."""
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_batch_tokens=64, max_num_seqs=1).resolved("cpu"), bm)
    seqs = {i: Sequence(i, [1, 2, 3], SamplingParams(max_new_tokens=1), arrival=i) for i in (0, 2, 3)}
    for s in seqs.values():
        sched.add(s)
    seqs[1] = Sequence(1, [1, 2, 3], SamplingParams(max_new_tokens=1), arrival=1)
    sched.add(seqs[1])
    order = []
    while sched.has_work():
        plan = sched.schedule()
        order += [s.req_id for s in plan.seqs]
        _run_plan(sched, plan, seqs)
        sched.remove_many([seqs[s.req_id] for s in plan.seqs])
    assert order == [0, 1, 2, 3]
    bm.check_invariants(sched.all_seqs())


def test_prefix_digests_are_keyed_per_process_and_chained():
    """A block's digest depends on every earlier token (the parent chain) and on a key drawn per process, so
    that no prompt can be crafted offline to collide with another's prefix (Python's hash() of ints can)."""
    import subprocess
    import sys

    from mii_async.workers.core.block_manager import block_digest

    first = block_digest(None, [1, 2, 3, 4])
    assert block_digest(first, [5, 6, 7, 8]) != block_digest(block_digest(None, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert block_digest(None, [1, 2, 3, 4]) == first and len(first) == 16
    other = subprocess.run([sys.executable, "-c", "from mii_async.workers.core.block_manager import block_digest; "
                            "print(block_digest(None, [1, 2, 3, 4]).hex())"], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other != first.hex()


def test_a_step_that_preempts_admits_no_one():
    """An 8- and a 16-token prompt fill a 6-block pool (no prefix cache, so that none of the blocks it gives up
    comes back to it as a hit); the older one's first decode needs a block, so the newer one is preempted,
    leaving 3 blocks free. It waits at the queue's head through that step (readmitted on the
    blocks it just gave up, it would be preempted again by the same growth) and comes back in a later one."""
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_batch_tokens=64, max_num_seqs=4).resolved("cpu"), bm)
    seqs = {i: Sequence(i, list(range(20 * i, 20 * i + 8 * (i + 1))), SamplingParams(max_new_tokens=8))
            for i in (0, 1)}
    for s in seqs.values():
        sched.add(s)
    plan = sched.schedule()
    assert [(s.req_id, len(s.token_ids)) for s in plan.seqs] == [(0, 8), (1, 16)] and bm.num_free == 0
    _run_plan(sched, plan, seqs)
    plan = sched.schedule()
    assert plan.num_preempted == 1 and bm.num_free == 3
    assert [s.req_id for s in plan.seqs] == [0] and list(sched.waiting) == [seqs[1]]
    bm.check_invariants(sched.all_seqs())
    _run_plan(sched, plan, seqs)
    sched.remove(seqs[0])                          # the older one ends: the next step readmits the newer
    plan = sched.schedule()
    assert plan.num_preempted == 0 and [s.req_id for s in plan.seqs] == [1]
    bm.check_invariants(sched.all_seqs())


def test_admission_leaves_the_watermark_while_others_run():
    """A 200-block pool keeps 2 blocks (1%) from a new request's chunk while another request runs, so the
    running one's next block does not preempt the newcomer; with no one running, the whole pool is there."""
    bm = BlockManager(200, 4)
    sched = Scheduler(SchedulerConfig(max_batch_tokens=2048, max_num_seqs=4).resolved("cpu"), bm)
    assert sched.watermark_blocks == 2
    seqs = {0: Sequence(0, list(range(100, 108)), SamplingParams(max_new_tokens=8)),   # 2 blocks
            1: Sequence(1, list(range(1000)), SamplingParams(max_new_tokens=8))}        # 250 blocks' worth
    for s in seqs.values():
        sched.add(s)
    plan = sched.schedule()
    assert [(s.req_id, len(s.token_ids)) for s in plan.seqs] == [(0, 8), (1, (200 - 2 - 2) * 4)]
    assert bm.num_free == 2
    _run_plan(sched, plan, seqs)
    plan = sched.schedule()                          # the decode's new block comes from the watermark
    assert plan.num_preempted == 0 and (plan.seqs[0].req_id, len(plan.seqs[0].block_table)) == (0, 3)
    bm.check_invariants(sched.all_seqs())
    alone = BlockManager(200, 4)
    solo = Scheduler(SchedulerConfig(max_batch_tokens=2048, max_num_seqs=4).resolved("cpu"), alone)
    solo.add(Sequence(2, list(range(1000)), SamplingParams(max_new_tokens=8)))
    assert len(solo.schedule().seqs[0].token_ids) == 800 and alone.num_free == 0
