"""The router under malformed frames (hypothesis): every bad frame is answered or dropped, counted, and the
router keeps serving."""
from __future__ import annotations

import asyncio

import msgpack
import zmq

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mii_async import protocol as P
from tests.mesh_helpers import raw_dealer

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=20),
                     st.binary(max_size=20))
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                       max_leaves=12)
_names = st.sampled_from(sorted(P._TYPES) + ["Nope", ""])

frames = st.one_of(
    st.binary(max_size=200),                                                       # random bytes
    st.builds(lambda d: msgpack.packb(d), st.dictionaries(st.text(max_size=8), _values, max_size=6)),
    st.builds(lambda t, d: msgpack.packb({"v": P.PROTOCOL_VERSION, "t": t, **d}), _names,
              st.dictionaries(st.sampled_from(["req_id", "prompt", "prompt_ids", "params", "messages", "what",
                                               "drain_s", "x"]), _values, max_size=4)),
    st.builds(lambda p: P.encode(P.Generate(req_id="fz", prompt="hi", params=p)),        # well formed, bad params
              st.dictionaries(st.sampled_from(["temperature", "top_p", "max_new_tokens", "stop", "seed", "logprobs",
                                               "bogus"]), _values, max_size=3)),
)


def test_router_survives_malformed_frames(deployment):
    """Random bytes, random msgpack, wrong fields and bad parameters: each gets an ErrorReply or is ignored
    (never a crash), the bad frames are counted, and a real request still works afterwards."""
    ctx = zmq.Context()
    s = raw_dealer(ctx, deployment.address)
    s.connect(deployment.address)
    workers = deployment.run(deployment.health())["worker_address"]
    w = raw_dealer(ctx, workers, "worker")
    w.connect(workers)
    before = deployment.run(deployment.health())["bad_frames"]
    sent = {"n": 0}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frames, st.booleans())
    def fuzz(frame: bytes, multipart: bool) -> None:
        try:
            kind = type(P.decode(frame))
        except P.ProtocolError:
            kind = None
        parts = [frame, b"extra"] if multipart else [frame]
        if kind is not P.Shutdown:                   # a well-formed Shutdown would (rightly) stop the router
            s.send_multipart(parts)
        if kind is not P.Hello:                      # a well-formed Hello would (rightly) join as a worker
            w.send_multipart(parts)
        sent["n"] += 1
        while s.poll(0):
            reply = P.decode(s.recv())
            assert isinstance(reply, (P.ErrorReply, P.Delta, P.DeltaBatch, P.QueryReply))

    fuzz()
    s.close()
    w.close()
    ctx.term()
    health = deployment.run(deployment.health())
    assert health["state"] == "ready" and health["bad_frames"] > before
    assert [r["state"] for r in health["replicas"]] == ["ready"]
    assert health["replicas"][0]["engine"]["num_blocks"] > 0          # the leader's heartbeat counters
    [r] = deployment(["The capital of France is"], max_new_tokens=4)
    assert r.generated_length == 4

    async def abort_leftovers():
        from tests.mesh_helpers import kv_idle
        await kv_idle(deployment, timeout_s=60)
    asyncio.run(abort_leftovers())


def test_stats_reports_count_only_from_the_replicas_leader(deployment):
    """A peer on the workers' socket that is not a replica's leader cannot answer the router's stats queries:
    a flood of StatsReports for every likely token leaves the counters the engine's own."""
    import threading

    ctx = zmq.Context()
    workers = deployment.run(deployment.health())["worker_address"]
    w = raw_dealer(ctx, workers, "worker")
    w.connect(workers)
    stop = threading.Event()
    bogus = {k: 10**9 for k in P.ENGINE_COUNTERS}

    def flood() -> None:
        while not stop.is_set():
            for token in range(40):         # the router numbers its queries from 0
                w.send(P.encode(P.StatsReport(token=token, replica=0, stats=bogus)))
            stop.wait(0.005)

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        for _ in range(30):
            stats = deployment.run(deployment.stats())
            assert stats["num_blocks"] < 10**9 and stats["running"] < 10**9, stats
    finally:
        stop.set()
        t.join()
        w.close()
        ctx.term()
