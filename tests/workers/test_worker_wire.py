"""The worker process as the engine loop's driver, on a real socket: what it sends for a step's outputs
(StepTokens, prompt logprobs packed as the engine gave them, a step with large prompt logprobs cut into several
frames), and how router messages become the loop's commands and its other outputs go back."""
from __future__ import annotations

import zmq

from mii_async import protocol as P
from mii_async.packed import prompt_logprobs_bytes
from mii_async.outputs import Logprob
from mii_async.workers import worker as worker_mod
from mii_async.workers.engine import EngineOutput
from tests.packed_logprobs import pack

N = 6


def _plps(n_tokens: int) -> P.PromptLogprobs:
    return pack([(-1.0 - i, [(j, -0.5 * (j + 1)) for j in range(N)]) for i in range(n_tokens - 1)], N)


def test_a_step_with_large_prompt_logprobs_is_cut_into_frames(monkeypatch):
    """Outputs go out in order; one output's prompt logprobs (packed: 8 + 8n bytes a position) are never
    split and go out byte for byte as the engine packed them; a frame takes more outputs only while its
    prompt logprobs stay under STEP_FRAME_BYTES; a step without prompt logprobs is one frame without the
    field. A sampled token's logprobs go out in their one wire form (Logprob.to_wire), None where not asked."""
    monkeypatch.setattr(worker_mod, "STEP_FRAME_BYTES", 10_000)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    w = worker_mod.Worker(f"tcp://127.0.0.1:{port}")
    try:
        assert 5_000 < worker_mod._packed_bytes(_plps(100)) < prompt_logprobs_bytes(100, N) < 10_000
        a, c, d = _plps(100), _plps(100), _plps(100)
        lp = Logprob(12, -0.5, [(12, -0.5), (3, -1.5)], 1)
        outs = [EngineOutput(1, 11, None, None, 0, a), EngineOutput(2, 12, lp, None, 0),
                EngineOutput(3, 13, None, "length", 0, c), EngineOutput(4, 14, None, None, 0, d)]
        w._send_tokens(outs)
        frames = []
        for _ in range(3):
            assert router.poll(5000), "a StepTokens is missing"
            frames.append(P.decode(router.recv_multipart()[1]))
        assert not router.poll(200)
        assert [f.req_ids for f in frames] == [[1, 2], [3], [4]]
        assert [t for f in frames for t in f.token_ids] == [11, 12, 13, 14]
        assert frames[0].prompt_logprobs[1] is None and frames[1].finish_reasons == ["length"]
        assert frames[0].logprobs == [None, [-0.5, [[12, -0.5], [3, -1.5]], 1]] and frames[1].logprobs is None
        sent = frames[0].prompt_logprobs[0]
        assert sent == a and frames[2].prompt_logprobs == [d]
        lps = sent.to_logprobs(list(range(100)))
        assert len(lps) == 100 and lps[0] is None
        assert lps[5] == Logprob(5, -5.0, [(j, -0.5 * (j + 1)) for j in range(N)], 1 + N)   # all N more likely
        w._send_tokens([EngineOutput(5, 15, None, None, 0)])
        assert router.poll(5000)
        plain = P.decode(router.recv_multipart()[1])
        assert plain.req_ids == [5] and plain.prompt_logprobs is None and plain.logprobs is None
    finally:
        w.sock.close()
        w.ctx.term()
        router.close()
        ctx.term()


def test_router_messages_become_loop_commands_and_outputs_go_back():
    """The leader's driver on a real socket: requests, aborts and stats queries become the loop's commands in
    order; a request's params are taken as the router sent them (checked there, not again: a value the router
    would refuse reaches the loop as it came, and nothing is answered); a bad frame is skipped; a Shutdown becomes a Stop. Back: an error end is a RequestFailed, an abort end sends nothing
    (the router ended it), a tagged Stats is a StatsReport and an untagged one only refreshes the heartbeat's
    counters."""
    from mii_async.params import SamplingParams
    from mii_async.workers.engine_loop import Abort, AddRequest, QueryStats, RequestEnded, Stats, Stop

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    w = worker_mod.Worker(f"tcp://127.0.0.1:{port}")

    def from_worker():
        assert router.poll(5000), "the worker sent nothing"
        return P.decode(router.recv_multipart()[1])

    try:
        w.sock.send(P.Heartbeat(replica=0, stats={}))        # the router learns the worker's routing id
        assert isinstance(from_worker(), P.Heartbeat)
        peer = w.name.encode()
        unchecked = {**SamplingParams().to_wire(), "temperature": -1.0}
        for msg in (P.AddRequest(req_id=1, prompt_ids=[5, 6], params=SamplingParams(max_new_tokens=3).to_wire()),
                    P.AddRequest(req_id=2, prompt_ids=[5], params=unchecked),
                    P.AbortRequest(req_id=1), P.StatsQuery(token=9, reset_prefix_cache=True)):
            router.send_multipart([peer, P.encode(msg)])
        router.send_multipart([peer, b"not msgpack"])
        router.send_multipart([peer, P.encode(P.Shutdown())])
        cmds = []
        for _ in range(100):                     # after a message that is no command it takes only what is
            if len(cmds) == 5:                   # there: None while the next is still on its way
                break
            if (cmd := w._receive(5.0)) is not None:
                cmds.append(cmd)
        assert cmds == [AddRequest(1, [5, 6], SamplingParams(max_new_tokens=3)),
                        AddRequest(2, [5], SamplingParams.from_wire(unchecked, trusted=True)), Abort(1),
                        QueryStats(9, True), Stop("the worker is stopping")]
        assert cmds[1].params.temperature == -1.0 and cmds[1].params.stop == ()
        assert w._receive(0.0) == Stop("the worker is stopping")            # stopping: no more commands
        assert not router.poll(200)                                          # nothing refused

        w._on_output(RequestEnded(3, "abort"))
        w._on_output(RequestEnded(4, "error", "engine step failed: RuntimeError: x", None))
        w._on_output(Stats(None, {"running": 1}))
        w._on_output(Stats(9, {"running": 2}, forgotten=5))
        failed, report = from_worker(), from_worker()
        assert (failed.req_id, failed.message, failed.param) == (4, "engine step failed: RuntimeError: x", None)
        assert (report.token, report.stats) == (9, {"running": 2, "prefix_blocks_forgotten": 5})
        assert w.stats == {"running": 2} and not router.poll(200)
    finally:
        w.sock.close()
        w.ctx.term()
        router.close()
        ctx.term()
