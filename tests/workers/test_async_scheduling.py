"""Async scheduling (step N+1 planned and launched before step N's ids are read) gives the outputs of the
synchronous engine: greedy, seeded sampling, penalties, logprobs, stops, preemption, prefix caching, aborts
in flight; no KV block leaks. On the CPU the device work is synchronous, but the bookkeeping is the same."""
from __future__ import annotations

import random

import pytest

from mii_async.params import SamplingParams

from .helpers import make_engine, run_engine


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 90))] for _ in range(12)]


def _both(path, prompts, engine_opts=None, **params):
    outs = []
    for mode in (False, True):
        engine = make_engine(path, async_scheduling=mode, **(engine_opts or {"num_blocks": 256}))
        assert engine.async_scheduling is mode
        outs.append(run_engine(engine, prompts, **params))
        assert not engine.has_work() and engine.flush() == []
    return outs


@pytest.mark.parametrize("opts", [{"num_blocks": 256}, {"num_blocks": 256, "max_batch_tokens": 16},
                                  {"num_blocks": 20, "block_size": 8}])
def test_greedy_batching_chunking_preemption(tiny_model, prompts, opts):
    sync, async_ = _both(tiny_model("llama"), prompts, opts, max_new_tokens=20, min_new_tokens=20)
    assert async_ == sync


def test_preemption_happens_under_async(tiny_model, prompts):
    engine = make_engine(tiny_model("llama"), async_scheduling=True, num_blocks=20, block_size=8)
    run_engine(engine, prompts, max_new_tokens=20, min_new_tokens=20)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_new_tokens=16),
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, max_new_tokens=16),
    dict(temperature=1.0, seed=9, repetition_penalty=1.2, max_new_tokens=12),
    dict(logprobs=3, max_new_tokens=10),
    dict(min_new_tokens=6, max_new_tokens=14),
])
def test_sampling_modes(tiny_model, prompts, params):
    """Seeded draws come from per-request generators, so they match whatever else is in the batch."""
    sync, async_ = _both(tiny_model("qwen2"), prompts[:6], **params)
    assert async_ == sync


def test_stops_end_requests_as_in_sync(tiny_model, prompts):
    """A stop id sampled while the next step is already launched ends the request with the same tokens."""
    path = tiny_model("llama")
    # ignore_eos in both runs (not min_new_tokens, which masks the stop ids too): the same logits, so the
    # second run's tokens are the first's up to the stop, whatever the random model's EOS does
    free = run_engine(make_engine(path, num_blocks=256), prompts, max_new_tokens=20, ignore_eos=True)
    stop = [o[5] for o in free]                      # each request's 6th token: a stop for a second run
    for mode in (False, True):
        engine = make_engine(path, num_blocks=256, async_scheduling=mode)
        finishes = {}
        for i, (p, s) in enumerate(zip(prompts, stop)):
            engine.add_request(i, p, SamplingParams(max_new_tokens=20, stop_token_ids=[s], ignore_eos=True))
        outs = {i: [] for i in range(len(prompts))}
        while engine.has_work():
            for o in engine.step():
                outs[o.req_id].append(o.token_id)
                if o.finish_reason:
                    finishes[o.req_id] = o.finish_reason
        assert engine.block_manager.num_free == engine.num_blocks
        for i, o in outs.items():
            assert o == free[i][:free[i].index(stop[i]) + 1] and finishes[i] == "stop"


def test_context_filled_ends_by_length(tiny_model):
    """A request that fills the context ends by length, and no step is planned past it."""
    engine = make_engine(tiny_model("llama"), num_blocks=64, max_model_len=40, async_scheduling=True)
    engine.add_request(1, list(range(3, 33)), SamplingParams(max_new_tokens=10, ignore_eos=True))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert len(outs) == 10 and outs[-1].finish_reason == "length"
    assert engine.num_steps == 10                  # the last token's step is not followed by a wasted one
    assert engine.block_manager.num_free == engine.num_blocks


def test_abort_in_flight(tiny_model, prompts):
    """Aborting a request whose token is in flight frees its blocks; the step's row for it is dropped."""
    path = tiny_model("llama")
    ref = run_engine(make_engine(path, num_blocks=256), prompts[:4], max_new_tokens=12, min_new_tokens=12)
    engine = make_engine(path, num_blocks=256, async_scheduling=True)
    sp = SamplingParams(max_new_tokens=12, min_new_tokens=12)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(i, p, sp)
    outs = {i: [] for i in range(4)}
    for _ in range(4):
        for o in engine.step():
            outs[o.req_id].append(o.token_id)
    assert engine._inflight is not None and any(s.req_id == 2 for s in engine._inflight.seqs)
    assert engine.abort(2)
    engine.block_manager.check_invariants(engine.seqs.values())
    while engine.has_work():
        for o in engine.step():
            assert o.req_id != 2
            outs[o.req_id].append(o.token_id)
    assert engine.block_manager.num_free == engine.num_blocks
    assert [outs[i] for i in (0, 1, 3)] == [ref[i] for i in (0, 1, 3)]
    assert outs[2] == ref[2][:len(outs[2])]


def test_prefix_cache_registers_blocks_after_placeholders(tiny_model, prompts):
    """Blocks that filled while their last token was a placeholder are hashed once it is read: a second
    request whose prompt is the first one's prompt + output hits them."""
    path = tiny_model("llama")
    for mode in (False, True):
        engine = make_engine(path, num_blocks=128, block_size=4, async_scheduling=mode)
        p = prompts[0][:30]
        (out,) = run_engine(engine, [p], max_new_tokens=18, min_new_tokens=18)
        hits = engine.stats()["prefix_hit_tokens"]
        run_engine(engine, [p + out], max_new_tokens=2, min_new_tokens=2)
        got = engine.stats()["prefix_hit_tokens"] - hits
        if mode is False:
            expected = got
        assert got == expected and got >= (len(p) + len(out) - 4) // 4 * 4, (mode, got)


@pytest.mark.parametrize("params", [dict(max_new_tokens=20, min_new_tokens=20),
                                    dict(max_new_tokens=14, temperature=0.9, seed=3, logprobs=2)])
def test_emit_hands_tokens_over_during_the_next_launch(tiny_model, prompts, params):
    """With `emit`, the step in flight's tokens are handed over between two layers of the next step's launch
    (on the CPU, at the first): the synchronous engine's tokens, none returned as well, the requests they end
    released after the launch, no KV block leaked."""
    path = tiny_model("llama")
    ref = run_engine(make_engine(path, num_blocks=256), prompts, **params)
    engine = make_engine(path, num_blocks=256, async_scheduling=True)
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(**params))
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    emitted = []

    def emit(batch):
        assert engine._inflight is None          # inside the launch: the new step is not in flight yet
        emitted.append(len(batch))
        for o in batch:
            outs[o.req_id].append(o.token_id)

    while engine.has_work():
        for o in engine.step(emit):
            outs[o.req_id].append(o.token_id)
        engine.block_manager.check_invariants(engine.seqs.values())
    assert [outs[i] for i in range(len(prompts))] == ref
    assert sum(emitted) > len(prompts) * 5       # most tokens went out early
    assert engine.block_manager.num_free == engine.num_blocks and not engine.seqs


def test_an_abort_from_emit_is_not_ended_twice(tiny_model, prompts):
    """A consumer that aborts its request from `emit` (it went away) while its last token is being handed
    over: the request is ended once, its blocks freed once, the others unaffected."""
    path = tiny_model("llama")
    sp = dict(max_new_tokens=12, min_new_tokens=12)
    ref = run_engine(make_engine(path, num_blocks=256), prompts[:4], **sp)
    engine = make_engine(path, num_blocks=256, async_scheduling=True)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(i, p, SamplingParams(**sp))
    outs: dict[int, list[int]] = {i: [] for i in range(4)}

    def emit(batch):
        for o in batch:
            outs[o.req_id].append(o.token_id)
            if o.req_id == 1 and o.finish_reason is not None or o.req_id == 2 and len(outs[2]) == 3:
                assert engine.abort(o.req_id)    # at its last token, and mid-stream

    while engine.has_work():
        for o in engine.step(emit):
            outs[o.req_id].append(o.token_id)
        engine.block_manager.check_invariants(engine.seqs.values())
    assert engine.block_manager.num_free == engine.num_blocks and not engine.seqs
    assert [outs[i] for i in (0, 1, 3)] == [ref[i] for i in (0, 1, 3)]
    assert outs[2] == ref[2][:3]


class _ConsumerFailed(Exception):
    pass


def _abort_all(engine):
    for req_id in list(engine.seqs):
        engine.abort(req_id)
    assert not engine.has_work() and engine.block_manager.num_free == engine.num_blocks
    engine.block_manager.check_invariants([])


def test_a_forward_that_fails_midway_caches_no_block_it_did_not_write(tiny_model, prompts):
    """`emit` raises between two layers of a step that prefills a long prompt (as a socket send that fails
    would): the prompt's blocks are not findable in the prefix cache afterwards, so the same prompt later is
    computed again, and gives the tokens of an engine that never failed."""
    path = tiny_model("llama")
    long = prompts[1] + prompts[2] + prompts[3]
    ref = run_engine(make_engine(path, num_blocks=128, block_size=4), [long], max_new_tokens=6, min_new_tokens=6)
    engine = make_engine(path, num_blocks=128, block_size=4, async_scheduling=True)
    sp = SamplingParams(max_new_tokens=30, min_new_tokens=30)
    engine.add_request(0, prompts[0], sp)
    for _ in range(3):
        engine.step()
    engine.add_request(1, long, sp)               # prefilled by the next step, which fails after a layer

    def emit(batch):
        raise _ConsumerFailed

    with pytest.raises(_ConsumerFailed):
        engine.step(emit)
    _abort_all(engine)
    assert engine.stats()["cached_blocks"] <= len(prompts[0]) // 4 + 4     # request 0's, not the long prompt's
    hits = engine.stats()["prefix_hit_tokens"]
    assert run_engine(engine, [long], max_new_tokens=6, min_new_tokens=6) == ref
    assert engine.stats()["prefix_hit_tokens"] == hits


def test_a_request_whose_last_token_went_out_is_released_when_the_launch_fails(tiny_model, prompts):
    """The step in flight is read early and its tokens handed over, one of them a request's last; then the
    launch fails. That request is released anyway: nothing is left running with no consumer."""
    engine = make_engine(tiny_model("llama"), num_blocks=256, async_scheduling=True)
    engine.add_request(0, prompts[0], SamplingParams(max_new_tokens=3, min_new_tokens=3))
    engine.add_request(1, prompts[1], SamplingParams(max_new_tokens=30, min_new_tokens=30))
    ended: list[int] = []
    execute = engine.runner.execute

    def failing(plan, ids=None, between_layers=None):
        out = execute(plan, ids, between_layers)       # may hand the step in flight's tokens to emit
        if ended:
            raise _ConsumerFailed                       # the launch fails after request 0's last token went out
        return out

    def emit(batch):
        ended.extend(o.req_id for o in batch if o.finish_reason)

    engine.runner.execute = failing
    with pytest.raises(_ConsumerFailed):
        for _ in range(10):
            engine.step(emit)
    assert ended == [0] and 0 not in engine.seqs and 1 in engine.seqs
    _abort_all(engine)


def test_a_request_whose_last_token_emit_raised_on_stays_live(tiny_model, prompts):
    """`emit` raises on the batch that holds a request's last token (a send that failed): that request is not
    released, so the caller's failure handling ends it (a worker sends RequestFailed for every live one)."""
    engine = make_engine(tiny_model("llama"), num_blocks=256, async_scheduling=True)
    engine.add_request(0, prompts[0], SamplingParams(max_new_tokens=3, min_new_tokens=3))
    engine.add_request(1, prompts[1], SamplingParams(max_new_tokens=30, min_new_tokens=30))

    def emit(batch):
        if any(o.req_id == 0 and o.finish_reason for o in batch):
            raise _ConsumerFailed

    with pytest.raises(_ConsumerFailed):
        for _ in range(10):
            engine.step(emit)
    assert 0 in engine.seqs and 1 in engine.seqs
    _abort_all(engine)


def test_a_seeded_request_aborted_from_emit_leaves_no_generator(tiny_model, prompts):
    """A seeded request aborted by its consumer while the next step is being launched: that step's row for
    it is dropped without giving it a generator again."""
    engine = make_engine(tiny_model("qwen2"), num_blocks=256, async_scheduling=True)
    sp = SamplingParams(max_new_tokens=12, min_new_tokens=12, temperature=0.9, seed=4)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(i, p, sp)
    seen: dict[int, int] = {}

    def emit(batch):
        for o in batch:
            seen[o.req_id] = seen.get(o.req_id, 0) + 1
            if o.req_id == 1 and seen[1] == 4:
                assert engine.abort(1)

    while engine.has_work():
        emit(engine.step(emit))                   # the last step's tokens are returned: no launch follows
    assert seen[1] == 4 and seen[0] == seen[2] == 12
    assert engine.sampler._generators == {} and not engine.seqs
    assert engine.block_manager.num_free == engine.num_blocks
