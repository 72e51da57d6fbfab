"""Background requests (priority > 0) in the router: held until a replica has spare capacity, sent in (priority,
arrival) order, never ahead of an interactive request, and ended cleanly while held; then a real deployment
flooded with them."""
from __future__ import annotations

import asyncio

import pytest

import mii_async
from mii_async import protocol as P
from mii_async.config import SchedulerConfig, ServeConfig
from mii_async.errors import InvalidParameterError
from mii_async.router.background_queue import BackgroundQueue
from mii_async.router.core import ToClient, ToReplica
from tests.mesh_helpers import deployment_pids, until, wait_gone, with_word_tokenizer
from tests.router.core_harness import Harness


def _harness(tokenizer, bound: int | None = 2, n: int = 1, **kw) -> Harness:
    h = Harness(tokenizer, n=n, **kw)
    h.core.background = BackgroundQueue(bound)
    return h


def _added(sends: list) -> list[int]:
    """The router request numbers of the AddRequests among `sends`, in order."""
    return [s.msg.req_id for s in sends if isinstance(s, ToReplica) and isinstance(s.msg, P.AddRequest)]


def _finish(h: Harness, *creqs: str) -> None:
    h.step(b"w0", {h.rid(c): 9 for c in creqs}, finish={h.rid(c): "length" for c in creqs})


def test_background_past_the_bound_is_held_and_sent_in_priority_then_arrival_order(tokenizer):
    """With a bound of 2, the third and later background requests wait; each finish sends the next held one,
    a lower priority number first even when it came later, then arrival order."""
    h = _harness(tokenizer)
    for c, prio in (("a", 1), ("b", 1), ("x", 2), ("c", 1), ("d", 1)):
        h.submit(c, priority=prio)
    rid = {c: h.rid(c) for c in "abxcd"}
    assert _added(h.sends()) == [rid["a"], rid["b"]]
    assert [x.rid for x in h.core.background.held()] == [rid["c"], rid["d"], rid["x"]]
    order = []
    for done in ("a", "b", "c", "d"):
        _finish(h, done)
        order += _added(h.sends())
    assert order == [rid["c"], rid["d"], rid["x"]]
    rep = h.replicas.replicas[0]
    assert h.core.background.stats([rep]) == {"held": 0, "in_flight": 1, "dispatched": 5, "interactive_encoding": 0,
                                              "interactive_recent": False, "replicas": {"0": {"in_flight": 1, "bound": 2, "peak": 2}}}


def test_an_interactive_request_goes_at_once_ahead_of_held_background_work(tokenizer):
    """Background at its bound and more held: an interactive request (priority 0, or below) is sent at once,
    before the held ones that came earlier."""
    h = _harness(tokenizer)
    for i in range(5):
        h.submit(f"b{i}", priority=1)
    h.sends()
    h.submit("now")
    h.submit("urgent", priority=-3)
    assert _added(h.sends()) == [h.rid("now"), h.rid("urgent")]
    assert len(h.core.background) == 3


def test_a_freed_slot_waits_while_an_interactive_request_is_encoding(tokenizer):
    """A background request that finishes while an interactive one is being encoded frees a slot that no held
    request takes until the interactive one is sent; then the held one follows it."""
    h = _harness(tokenizer)
    for i in range(3):
        h.submit(f"b{i}", priority=1)
    h.sends()
    job = h.submit("now", encode=False)
    _finish(h, "b0")
    assert _added(h.sends()) == []
    h.encode(job)
    assert _added(h.sends()) == [h.rid("now"), h.rid("b2")]


def test_an_interactive_request_refused_or_aborted_while_encoding_frees_the_held_ones(tokenizer):
    """An interactive request that never reaches a replica (refused once encoded, or aborted while encoding)
    stops holding background work back."""
    h = _harness(tokenizer, bound=1, context=64)
    h.submit("b0", priority=1, max_new_tokens=8)
    h.submit("b1", priority=1, max_new_tokens=8)
    job = h.submit("too-long", "w5 " * 80, encode=False, max_new_tokens=8)
    assert job is not None
    _finish(h, "b0")
    h.sends()
    h.encode(job)                                     # refused: the prompt does not fit the context
    sends = h.sends()
    assert _added(sends) == [h.rid("b1")]
    assert any(isinstance(s.msg, P.ErrorReply) and s.msg.req_id == "too-long" for s in sends)
    h.submit("gone", encode=False, max_new_tokens=8)
    _finish(h, "b1")
    h.submit("b2", priority=1, max_new_tokens=8)
    assert _added(h.sends()) == []
    h.core.abort(b"c", "gone")
    assert _added(h.sends()) == [h.rid("b2")]


def test_a_held_request_aborted_or_its_client_silent_ends_cleanly(tokenizer):
    """An aborted held request gets its abort Delta, nothing reaches a replica for it and it leaves the queue;
    a silent client's held request ends the same way; freed capacity goes to the ones still held."""
    h = _harness(tokenizer, bound=1)
    h.submit("run", priority=1)
    h.submit("held", priority=1)
    h.submit("quiet", priority=1, peer=b"q")
    h.submit("next", priority=1)
    h.core.heard_from(b"c", 100.0)
    h.core.heard_from(b"q", 0.0)
    h.sends()
    h.core.abort(b"c", "held")
    [s] = h.sends()
    assert isinstance(s, ToClient) and s.msg.req_id == "held" and s.msg.finish_reason == "abort"
    h.core.expire_clients(now=100.0, timeout_s=30.0)
    [s] = h.sends()
    assert s.peer == b"q" and s.msg.finish_reason == "abort" and s.msg.error == "client timed out"
    assert [x.rid for x in h.core.background.held()] == [h.rid("next")]
    _finish(h, "run")
    assert _added(h.sends()) == [h.rid("next")]
    assert len(h.core.requests) == 1 and len(h.core.background) == 0


def test_many_aborted_held_requests_leave_nothing_behind(tokenizer):
    """Held requests that end in any number leave the queue's order bounded by those still held."""
    h = _harness(tokenizer, bound=1)
    h.submit("run", priority=1)
    for i in range(300):
        h.submit(f"h{i}", priority=1)
        h.core.abort(b"c", f"h{i}")
    h.sends()
    q = h.core.background
    assert len(q) == 0 and len(q._heap) <= 64 and q.interactive_encoding == set()
    _finish(h, "run")
    assert len(h.core.requests) == 0 and q.stats([h.replicas.replicas[0]])["in_flight"] == 0


def test_held_work_never_makes_an_interactive_request_overloaded(tokenizer):
    """Held requests do not count against max_queued_tokens, so an interactive request is still admitted beside
    them; a held one is sent only once its cost fits beside the dispatched requests'."""
    h = _harness(tokenizer, bound=1, max_queued_tokens=300)
    h.submit("b0", priority=1, max_new_tokens=47)    # prompts of 3 tokens: cost 50
    h.submit("b1", priority=1, max_new_tokens=197)   # cost 200: held behind b0
    h.submit("now", max_new_tokens=147)              # cost 150: 50 + 150 dispatched, b1's 200 not counted
    assert _added(h.sends()) == [h.rid("b0"), h.rid("now")]
    _finish(h, "b0")
    assert _added(h.sends()) == []                   # a slot, but 150 + 200 would pass 300
    assert h.core.requests.queued_tokens == 150
    _finish(h, "now")
    assert _added(h.sends()) == [h.rid("b1")]
    assert h.core.requests.queued_tokens == 200


def test_held_requests_go_to_another_replica_or_are_refused_when_none_is_ready(tokenizer):
    """A replica's death ends its requests; held ones go to the replicas left with room, and when no replica is
    ready they are refused as "unavailable", as a request encoded then would be."""
    h = _harness(tokenizer, bound=1, n=2)
    for i in range(4):
        h.submit(f"b{i}", priority=1)
    assert {s.peer for s in h.sends()} == {b"w0", b"w1"}
    rep0, rep1 = h.replicas.replicas[0], h.replicas.replicas[1]
    rep0.state = "dead"
    h.core.fail_replica(rep0, "gone")
    sends = h.sends()
    assert [(s.peer, s.msg.req_id) for s in sends if isinstance(s, ToReplica)] == []
    assert len(h.core.background) == 2               # replica 1 is at its bound
    rep1.state = "dead"
    h.core.fail_replica(rep1, "gone")
    refused = [s.msg for s in h.sends() if isinstance(s.msg, P.ErrorReply)]
    assert sorted(m.req_id for m in refused) == ["b2", "b3"] and {m.code for m in refused} == {"unavailable"}
    assert len(h.core.requests) == 0 and len(h.core.background) == 0


def test_a_dead_replicas_background_slots_go_to_the_survivor(tokenizer):
    """When one of two replicas dies, the held requests wait for room on the other."""
    h = _harness(tokenizer, bound=1, n=2)
    for i in range(3):
        h.submit(f"b{i}", priority=1)
    h.sends()
    rep0 = h.replicas.replicas[0]
    rep0.state = "dead"
    h.core.fail_replica(rep0, "gone")
    h.sends()
    on1 = next(c for c in ("b0", "b1") if h.core.requests.find(b"c", c) is not None)
    h.step(b"w1", {h.rid(on1): 9}, finish={h.rid(on1): "length"})
    assert [(s.peer, s.msg.req_id) for s in h.sends() if isinstance(s, ToReplica)] == [(b"w1", h.rid("b2"))]


def test_the_default_bound_is_a_quarter_of_the_running_slots_on_a_gpu_and_2_or_1_on_the_cpu(tokenizer):
    """None: on a GPU max(2, max_num_seqs // 4), from what the replica reported, else the scheduler's for the
    device; on the CPU 2, and 1 while interactive traffic is recent."""
    h = _harness(tokenizer, bound=None)
    rep = h.replicas.replicas[0]
    q = h.core.background
    assert (q.bound(rep), q.bound(rep, True)) == (2, 1)      # the CPU
    rep.generation = 1
    rep.workers[0].info["device"] = "cuda:0"
    assert (q.bound(rep), q.bound(rep, True)) == (64, 64)    # a GPU: 256 running sequences
    rep.generation = 2
    rep.workers[0].info["max_num_seqs"] = 5
    assert q.bound(rep) == 2
    rep.generation = 3
    q.scheduler = SchedulerConfig(max_num_seqs=40)
    del rep.workers[0].info["max_num_seqs"]
    assert q.bound(rep) == 10


def test_recent_interactive_traffic_lowers_the_cpu_bound(tokenizer):
    """With no interactive request yet, two batch lines go to the CPU replica; once one has arrived (and been
    answered), a finished line is replaced only while fewer than one are in flight: none is sent until the
    other finishes too. The health figures say so."""
    h = _harness(tokenizer, bound=None)
    q = h.core.background
    assert not q.interactive_recent()
    for i in range(4):
        h.submit(f"b{i}", priority=1)
    assert _added(h.sends()) == [h.rid("b0"), h.rid("b1")]
    h.submit("chat")
    assert _added(h.sends()) == [h.rid("chat")]
    _finish(h, "chat")
    assert q.interactive_recent()
    assert q.stats(list(h.replicas.replicas.values()))["replicas"]["0"]["bound"] == 1
    _finish(h, "b0")
    assert _added(h.sends()) == []
    _finish(h, "b1")
    assert _added(h.sends()) == [h.rid("b2")]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_a_bad_bound_is_refused_naming_it(bad):
    with pytest.raises(InvalidParameterError) as e:
        ServeConfig(max_background_per_replica=bad)
    assert e.value.param == "max_background_per_replica"
    with pytest.raises(InvalidParameterError) as e:
        BackgroundQueue(bad)
    assert e.value.param == "max_background_per_replica"


# -- a real deployment -----------------------------------------------------------------------------------
N_BACKGROUND = 30
BACKGROUND = dict(priority=1, max_new_tokens=128, ignore_eos=True)


async def _flood_then_interactive(client) -> tuple[dict, dict, list, list]:
    """30 background requests, then, once the router holds every one of them, an interactive request; returns
    the router's background figures when all had arrived and at the interactive request's first token, and the
    streams' chunks."""
    async def run(prompt: list[int], **params) -> list:
        return [c async for c in client.stream(prompt, **params)]

    bg = [asyncio.create_task(run([1, 5 + i, 9], **BACKGROUND)) for i in range(N_BACKGROUND)]

    async def all_in() -> dict | None:
        b = (await client.health())["background"]
        return b if b["held"] + b["in_flight"] + sum(t.done() for t in bg) == N_BACKGROUND else None

    arrived = await until(all_in, 60, "every background request to reach the router")
    at_first: dict = {}
    chunks = []
    async for c in client.stream([1, 7, 9], max_new_tokens=8, ignore_eos=True):
        if not at_first:
            at_first = (await client.health())["background"]
        chunks.append(c)
    return arrived, at_first, chunks, await asyncio.gather(*bg)


@pytest.mark.slow
def test_a_flood_of_background_requests_leaves_an_interactive_one_first_in_line(tiny_model, tmp_path):
    """30 priority-1 requests against a replica bound to 2 background requests in flight: the rest wait in the
    router; an interactive request sent then gets its first token while background requests that came before
    it are still held; the replica never has more than 2 in flight, and every request finishes."""
    path = with_word_tokenizer(tiny_model("llama"), tmp_path / "tiny")
    client = mii_async.serve(str(path), num_blocks=256, max_background_per_replica=2)
    pids = [client._process.pid] + deployment_pids(client.run(client.health()))
    try:
        arrived, at_first, chunks, streams = client.run(_flood_then_interactive(client))
        assert arrived["held"] > 0 and arrived["replicas"]["0"]["bound"] == 2, arrived
        assert at_first["held"] > 0, at_first       # older background requests still wait: it went first
        assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 8
        for s in streams:
            assert s[-1].finish_reason == "length" and sum(len(c.token_ids) for c in s) == 128
        end = client.run(client.health())["background"]
        assert end["held"] == end["in_flight"] == 0 and end["dispatched"] == N_BACKGROUND, end
        assert end["replicas"]["0"]["peak"] == 2, end      # the bound was reached, never passed
        assert client.run(client.health())["live_requests"] == 0
    finally:
        client.terminate_server_sync(drain_s=0)
        assert not wait_gone(pids), "processes left behind"
