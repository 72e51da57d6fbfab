"""The engine loop without processes or sockets, on a tiny random Llama (CPU, float32): commands in, outputs out;
a bad request, a failed step and a guide that cannot compile are answered and the loop goes on; an abort frees
the request's KV blocks; a stop reads the step in flight and ends every live request."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import pytest

from mii_async.params import SamplingParams
from mii_async.workers.engine_loop import (Abort, AddRequest, Command, EngineLoop, Output, QueryStats, RequestEnded,
                                           Stats, Stop, Tokens)
from mii_async.workers.sampling.guide_compiler import CompileError
from mii_async.workers.sampling.guides import GuidedRequests

from .helpers import make_engine


class Driver:
    """A driver as the worker's and the pipeline's are, over a deque: `receive` hands out the queued commands
    and, once the loop is idle with nothing queued, a Stop; every output is kept in order. One `run` (a loop
    lifetime) per driver."""

    def __init__(self, engine, stats_refresh_s: float | None = None) -> None:
        self.inbox: deque[Command] = deque()
        self.outs: list[Output] = []
        self.idle_waits = 0
        self.loop = EngineLoop(engine, self.outs.append, stats_refresh_s)

    def receive(self, timeout: float | None) -> Command | None:
        if self.inbox:
            return self.inbox.popleft()
        if timeout is None:
            self.idle_waits += 1
            return Stop("idle")
        return None

    def run(self, *cmds: Command) -> list[Output]:
        assert not self.loop.stopped, "one run per driver"
        self.inbox.extend(cmds)
        start = len(self.outs)
        self.loop.run(self.receive)
        return self.outs[start:]


def tokens_of(outs: list[Output]) -> dict[int, list]:
    """req_id → its EngineOutputs, in order."""
    got: dict[int, list] = {}
    for out in outs:
        if isinstance(out, Tokens):
            assert out.outputs, "a Tokens output is never empty"
            for o in out.outputs:
                got.setdefault(o.req_id, []).append(o)
    return got


def ended(outs: list[Output]) -> list[RequestEnded]:
    return [o for o in outs if isinstance(o, RequestEnded)]


def assert_idle(engine) -> None:
    bm = engine.block_manager
    assert not engine.has_work() and not engine.seqs
    assert bm.num_free == bm.num_blocks, f"{bm.num_blocks - bm.num_free} KV blocks held"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_in_tokens_out_until_idle(model, async_scheduling):
    """Each request's tokens come out in order, as many as it asked for, the last with its finish_reason; a
    stats query is answered with its tag; the loop waits only once all work is done, and a Stop then ends it
    with nothing held."""
    engine = make_engine(model, num_blocks=64, async_scheduling=async_scheduling)
    d = Driver(engine)
    outs = d.run(AddRequest(1, [5, 6, 7, 8], SamplingParams(max_new_tokens=5, ignore_eos=True)),
                 AddRequest(2, [9, 10, 11], SamplingParams(max_new_tokens=3, ignore_eos=True)),
                 QueryStats("tag-1"))
    got = tokens_of(outs)
    assert [len(got[1]), len(got[2])] == [5, 3]
    for toks in got.values():
        assert [o.finish_reason for o in toks] == [None] * (len(toks) - 1) + ["length"]
    stats = [o for o in outs if isinstance(o, Stats)]
    assert len(stats) == 1 and stats[0].tag == "tag-1" and stats[0].forgotten is None
    assert stats[0].stats["waiting"] == 2                 # answered before the first step
    assert ended(outs) == [] and d.idle_waits == 1 and d.loop.stopped
    assert_idle(engine)


def test_a_bad_request_is_answered_and_the_loop_goes_on(model):
    """A request the engine cannot hold (its driver checks the limits, the engine asserts them), and one whose id
    is live, each end with an error naming why; the live one still completes."""
    engine = make_engine(model, num_blocks=64, max_model_len=32)
    d = Driver(engine)
    outs = d.run(AddRequest(1, [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)),
                 AddRequest(2, list(range(3, 43)), SamplingParams(max_new_tokens=4)),
                 AddRequest(1, [5, 6], SamplingParams(max_new_tokens=2)))
    errors = ended(outs)
    assert [(e.req_id, e.reason) for e in errors] == [(2, "error"), (1, "error")]
    assert "AssertionError" in errors[0].message and "limits (32 tokens)" in errors[0].message
    assert "already live" in errors[1].message
    assert [o.finish_reason for o in tokens_of(outs)[1]] == [None] * 3 + ["length"]
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_the_kv_blocks(model, async_scheduling):
    """An Abort between steps ends the request (RequestEnded "abort", no more tokens) and gives back its blocks;
    an Abort of a request that is not live says nothing."""
    engine = make_engine(model, num_blocks=64, block_size=4, async_scheduling=async_scheduling)
    d = Driver(engine)
    d.loop.handle(AddRequest(7, list(range(3, 40)), SamplingParams(max_new_tokens=50, ignore_eos=True)))
    for _ in range(3):
        d.loop.step()
    used = engine.block_manager.num_blocks - engine.block_manager.num_free
    assert used >= 10                                     # 37 prompt tokens and more, in blocks of 4
    before = len(tokens_of(d.outs).get(7, []))
    d.loop.handle(Abort(7))
    assert d.outs[-1] == RequestEnded(7, "abort")
    d.loop.handle(Abort(7))
    d.loop.handle(Abort(12345))
    assert d.outs[-1] == RequestEnded(7, "abort")
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    d.run()                                               # a step in flight, if any, drops the aborted row
    assert len(tokens_of(d.outs).get(7, [])) == before
    assert_idle(engine)


def test_stop_reads_the_step_in_flight_and_ends_every_request(model):
    """With async scheduling a Stop first hands out the tokens of the step in flight (no computed token is
    lost), then ends each live request with "abort" and Stop's message; nothing is left held or in flight."""
    engine = make_engine(model, num_blocks=64, async_scheduling=True)
    d = Driver(engine)
    d.loop.handle(AddRequest(1, [5, 6, 7, 8], SamplingParams(max_new_tokens=40, ignore_eos=True)))
    d.loop.handle(AddRequest(2, [9, 10, 11], SamplingParams(max_new_tokens=40, ignore_eos=True)))
    d.loop.step()
    d.loop.step()
    assert engine._inflight is not None                  # launched, not read
    in_flight = sorted(s.req_id for s in engine._inflight.seqs)
    before = len(d.outs)
    d.loop.handle(Stop("closing"))
    after = d.outs[before:]
    assert isinstance(after[0], Tokens) and sorted(o.req_id for o in after[0].outputs) == in_flight == [1, 2]
    assert all(o.finish_reason is None for o in after[0].outputs)
    assert after[1:] == [RequestEnded(1, "abort", "closing"), RequestEnded(2, "abort", "closing")]
    assert d.loop.stopped and engine._inflight is None
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_ends_the_live_requests_and_the_loop_goes_on(model, async_scheduling):
    """A step whose forward raises ends every live request with an error naming the failure and frees their
    blocks; the next request is served."""
    engine = make_engine(model, num_blocks=64, async_scheduling=async_scheduling)
    d = Driver(engine)
    execute, calls = engine.runner.execute, []

    def failing(plan, ids=None, between_layers=None):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return execute(plan, ids, between_layers)

    engine.runner.execute = failing
    outs = d.run(AddRequest(1, [5, 6, 7, 8], SamplingParams(max_new_tokens=20, ignore_eos=True)),
                 AddRequest(2, [9, 10, 11], SamplingParams(max_new_tokens=20, ignore_eos=True)))
    assert [(e.req_id, e.reason, e.message) for e in ended(outs)] == \
        [(r, "error", "engine step failed: RuntimeError: injected") for r in (1, 2)]
    assert_idle(engine)
    outs = Driver(engine).run(AddRequest(3, [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True)))
    assert [o.finish_reason for o in tokens_of(outs)[3]] == [None, None, "length"] and ended(outs) == []
    assert_idle(engine)


class RefusingCompiler:
    """The guide compiler's interface, refusing every guide for good once the test says (outlines-core
    refusing a regex): its requests wait compiling until then."""

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def index(self, guide) -> Future:
        self.futures.append(Future())
        return self.futures[-1]

    def refuse(self) -> None:
        for fut in self.futures:
            fut.set_exception(CompileError("the regex is refused", lasting=True))

    def release(self, fut: Future) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_guide_that_cannot_compile_fails_its_request_naming_the_field(model):
    """A guided request waits while its guide compiles, the others step meanwhile; a compile that fails for
    good ends it with an error that names the guide's field."""
    engine = make_engine(model, num_blocks=64)
    compiler = RefusingCompiler()
    engine.guided = GuidedRequests(compiler)             # type: ignore[arg-type]
    d = Driver(engine)
    d.loop.handle(AddRequest(1, [5, 6, 7], SamplingParams(max_new_tokens=8, guided_regex="[a-c]{2,6}")))
    d.loop.handle(AddRequest(2, [9, 10, 11], SamplingParams(max_new_tokens=2, ignore_eos=True)))
    d.loop.step()
    d.loop.step()
    assert 1 in engine.seqs and ended(d.outs) == [] and len(tokens_of(d.outs)[2]) == 2
    compiler.refuse()
    d.loop.step()
    assert ended(d.outs) == [RequestEnded(1, "error", "the regex is refused", "guided_regex")]
    assert 1 not in tokens_of(d.outs)
    assert_idle(engine)


def test_stats_refresh_while_stepping(model):
    """With stats_refresh_s, stepping hands out untagged Stats at most that often (the worker's heartbeats
    carry them); without it, none."""
    for refresh, some in ((0.0, True), (None, False)):
        engine = make_engine(model, num_blocks=64)
        d = Driver(engine, stats_refresh_s=refresh)
        outs = d.run(AddRequest(1, [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)))
        untagged = [o for o in outs if isinstance(o, Stats) and o.tag is None]
        assert bool(untagged) is some
        if some:
            assert untagged[-1].stats["running"] == 0 and untagged[-1].stats["steps"] == engine.num_steps


def test_reset_prefix_cache_is_reported(model):
    """A QueryStats that resets the prefix cache reports how many blocks it forgot: those a finished request
    left cached."""
    engine = make_engine(model, num_blocks=64, block_size=4)
    d = Driver(engine)
    d.run(AddRequest(1, list(range(3, 23)), SamplingParams(max_new_tokens=2, ignore_eos=True)))
    cached = engine.block_manager.stats().num_cached
    assert cached > 0
    outs = Driver(engine).run(QueryStats("r", reset_prefix_cache=True), QueryStats("again", reset_prefix_cache=True))
    assert [(o.tag, o.forgotten) for o in outs] == [("r", cached), ("again", 0)]
    assert outs[0].stats["cached_blocks"] == 0
