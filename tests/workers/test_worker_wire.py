"""What a worker sends for a step's outputs: StepTokens on a real socket, prompt logprobs packed as the
engine gave them, and a step with large prompt logprobs cut into several frames."""
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
    field."""
    monkeypatch.setattr(worker_mod, "STEP_FRAME_BYTES", 10_000)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    w = worker_mod.Worker(f"tcp://127.0.0.1:{port}")
    try:
        assert 5_000 < worker_mod._packed_bytes(_plps(100)) < prompt_logprobs_bytes(100, N) < 10_000
        a, c, d = _plps(100), _plps(100), _plps(100)
        outs = [EngineOutput(1, 11, None, None, 0, a), EngineOutput(2, 12, None, None, 0),
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
