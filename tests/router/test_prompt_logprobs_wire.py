"""Prompt logprobs on the wire: a real router process with a scripted worker (a DEALER socket that joins as a
remote replica) checks what the router accepts from a worker and what it refuses from a client."""
from __future__ import annotations

import asyncio
import os
import socket

import pytest
import zmq

import mii_async
from mii_async import protocol as P
from mii_async.packed import prompt_logprobs_bytes
from mii_async.outputs import Logprob
from tests.mesh_helpers import present_keys, until, wait_gone, with_word_tokenizer
from tests.packed_logprobs import pack, raw

LIMITS = {"vocab_size": 320, "max_model_len": 100_000, "max_request_tokens": 100_000, "num_blocks": 8,
          "block_size": 16}


class ScriptedWorker:
    """Joins the router as replica -1 → its own remote replica, and answers requests as a test tells it."""

    def __init__(self, address: str, keys_dir: str, info: dict | None = None, tag: str = "scripted") -> None:
        self.name = f"{socket.gethostname()}:{os.getpid()}:{tag}"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        present_keys(self.sock, keys_dir, "worker")
        self.sock.setsockopt(zmq.IDENTITY, self.name.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.send(P.Hello(worker=self.name, replica=-1, rank=0, pid=os.getpid(), host=socket.gethostname()))
        assign = self.recv(P.Assign)
        self.replica = assign.replica
        self.send(P.Ready(replica=assign.replica, rank=0, info=dict(LIMITS) if info is None else info))

    def send(self, msg: P.Message) -> None:
        self.sock.send(P.encode(msg))

    def recv(self, kind: type, timeout_s: float = 30.0):
        """The next message of `kind` (heartbeat echoes and the like are skipped)."""
        while True:
            assert self.sock.poll(int(timeout_s * 1000)), f"no {kind.__name__} from the router"
            msg = P.decode(self.sock.recv())
            if isinstance(msg, kind):
                return msg

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def router(tiny_model, tmp_path_factory):
    """A router that starts no replica, and one scripted worker joined to it."""
    path = with_word_tokenizer(tiny_model("llama"), tmp_path_factory.mktemp("wire") / "tiny")
    client = mii_async.serve(str(path), replicas=0, tensor_parallel=1, heartbeat_timeout_s=300.0)
    worker = ScriptedWorker(client.run(client.health())["worker_address"], client.curve_dir)

    async def ready():
        return [r["state"] for r in (await client.health())["replicas"]] == ["ready"]
    client.run(until(ready, 30, "the scripted worker's replica"))
    yield client, worker
    client.terminate_server_sync(drain_s=0)
    worker.close()
    assert not wait_gone([client._process.pid]), "the router was left behind"


def _ask(client, prompt, **params):
    """Starts client.generate on its loop thread; the caller plays the worker, then reads .result()."""
    async def ask():                      # made on the loop thread: there, generate is a coroutine to await
        return await client.generate([prompt], **params)
    return asyncio.run_coroutine_threadsafe(ask(), _loop(client))


def _loop(client):
    client.run(asyncio.sleep(0))          # starts the client's private loop thread
    return client._sync_loop


def test_prompt_logprobs_reach_the_client(router):
    """A worker's packed prompt logprobs arrive as Logprobs with the prompt's token ids and, added by the
    router (the worker has no tokenizer), the texts of each token and its alternatives."""
    client, w = router
    prompt = [1, 5, 9, 33]
    fut = _ask(client, prompt, max_new_tokens=2, prompt_logprobs=2)
    add = w.recv(P.AddRequest)
    assert add.prompt_ids == prompt and add.params["prompt_logprobs"] == 2
    plps = pack([(-1.0 - i, [(5, -0.5), (6, -1.5)]) for i in range(3)], 2, ranks=[2, 40, 319])
    w.send(P.StepTokens(req_ids=[add.req_id], token_ids=[8], finish_reasons=[None], cached_tokens=[0], logprobs=None, prompt_logprobs=[plps]))
    w.send(P.StepTokens(req_ids=[add.req_id], token_ids=[9], finish_reasons=["length"], cached_tokens=[0]))
    [r] = fut.result(30)
    assert r.token_ids == [8, 9]
    assert r.prompt_logprobs == [None] + [Logprob(t, -1.0 - i, [(5, -0.5), (6, -1.5)], rank)
                                          for i, (t, rank) in enumerate(zip(prompt[1:], (2, 40, 319)))]
    assert [(x.text, x.top_texts) for x in r.prompt_logprobs[1:]] == [(f"w{t}", ["w5", "w6"]) for t in prompt[1:]]


def test_the_router_forwards_the_packed_bytes(router):
    """The client's Delta carries the prompt logprobs byte for byte as the worker sent them (nothing decoded
    and re-encoded in the router), with the prompt's ids and the texts of every id they name (once each), in a
    frame of its own: read here on a raw socket."""
    client, w = router
    prompt = [1] + [7] * 999
    plps = pack([(-0.1 * (i % 50), [(i % 320, -0.01 * i), (3, -9.5)]) for i in range(999)], 2)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    present_keys(sock, client.curve_dir, "client")
    try:
        sock.connect(client.address)
        sock.send(P.encode(P.Generate(req_id="raw", prompt_ids=prompt, params={"max_new_tokens": 1,
                                                                        "prompt_logprobs": 2})))
        add = w.recv(P.AddRequest)
        w.send(P.StepTokens(req_ids=[add.req_id], token_ids=[5], finish_reasons=["length"], cached_tokens=[0], logprobs=None, prompt_logprobs=[plps]))
        assert sock.poll(30_000), "no Delta"
        d = P.decode(sock.recv())
        assert isinstance(d, P.Delta) and d.prompt_ids == prompt and d.token_ids == [5]
        assert d.prompt_logprobs == plps and d.finish_reason == "length"
        assert sorted(d.token_texts.texts) == sorted({1, 7, 3} | {i % 320 for i in range(999)})
        assert d.token_texts.text(7) == "w7" and d.token_texts.token_bytes(300) == b"w300"
    finally:
        sock.close()
        ctx.term()


def _bad_cases():
    good = [(-1.0, [(5, -0.5)])] * 3
    return {
        "one position short": pack(good[:2], 1),
        "one position too many": pack(good * 2, 1),
        "top arrays of 2 for n=1": raw(1, [-1.0] * 3, [5, 6] * 3, [-0.5, -1.0] * 3),
        "top ids shorter than top logprobs": [1, pack(good, 1).own, b"\x05\x00\x00\x00",
                                              pack(good, 1).top_logprobs, pack(good, 1).ranks],
        "no ranks": list(pack(good, 1))[:4],
        "a rank short": [*list(pack(good, 1))[:4], pack(good, 1).ranks[:8]],
        "a rank of 0": pack(good, 1, ranks=[1, 0, 2]),
        "a rank past the vocabulary": pack(good, 1, ranks=[1, 321, 2]),
        "a length not a whole float32": [1, b"\x00" * 11, b"\x00" * 11, b"\x00" * 11, b"\x00" * 11],
        "n larger than asked": pack([(-1.0, [(5, -0.5), (6, -1.0)])] * 3, 2),
        "a nan logprob": pack([good[0], (float("nan"), [(5, -0.5)]), good[0]], 1),
        "an inf logprob": pack([good[0], (float("-inf"), [(5, -0.5)]), good[0]], 1),
        "an inf top logprob": pack([good[0], (-1.0, [(5, float("inf"))]), good[0]], 1),
        "an id outside the vocabulary": pack([good[0], (-1.0, [(320, -0.5)]), good[0]], 1),
        "the largest id": pack([good[0], (-1.0, [(2**32 - 1, -0.5)]), good[0]], 1),
        "a negative n": [-1, b"", b"", b"", b""],
        "a list, not packed": [None, [-1.0, [[5, -0.5]]], [-1.0, [[5, -0.5]]], [-1.0, [[5, -0.5]]], [1]],
        "a string": "x",
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_malformed_prompt_logprobs_fail_the_request(router, case):
    """Prompt logprobs that do not match the request (one position per prompt token after the first, at most
    the alternatives it asked for, finite numbers, ids in the vocabulary, a rank in 1 … vocabulary for each
    position) end it with finish_reason "error"
    (and an abort to the replica) instead of reaching the client malformed; a request beside it in the same
    StepTokens gets its token and its own prompt logprobs, and the next request is served as usual."""
    client, w = router
    bad = _bad_cases()[case]
    fut = _ask(client, [1, 5, 9, 33], max_new_tokens=2, prompt_logprobs=1)
    add = w.recv(P.AddRequest)
    other = _ask(client, [1, 5], max_new_tokens=1, logprobs=1, prompt_logprobs=3)
    add2 = w.recv(P.AddRequest)
    good = pack([(-0.75, [(4, -0.5), (5, -0.75), (6, -2.0)])], 3)
    w.send(P.StepTokens(req_ids=[add.req_id, add2.req_id], token_ids=[8, 9], finish_reasons=[None, "length"], cached_tokens=[0, 0],
                        logprobs=[None, [-0.25, [[9, -0.25]], 1]], prompt_logprobs=[bad, good]))
    assert w.recv(P.AbortRequest).req_id == add.req_id
    [r] = fut.result(30)
    assert r.finish_reason == "error" and "malformed logprobs" in r.error
    assert r.prompt_logprobs is None
    [r2] = other.result(30)
    assert r2.token_ids == [9] and r2.logprobs == [Logprob(9, -0.25, [(9, -0.25)], 1)]
    assert r2.prompt_logprobs == [None, Logprob(5, -0.75, [(4, -0.5), (5, -0.75), (6, -2.0)], 2)]
    after = _ask(client, [1, 5, 9, 33], max_new_tokens=1, prompt_logprobs=1)
    add3 = w.recv(P.AddRequest)
    w.send(P.StepTokens(req_ids=[add3.req_id], token_ids=[8], finish_reasons=["length"], cached_tokens=[0], logprobs=None, prompt_logprobs=[pack([(-1.0, [(5, -0.5)])] * 3, 1)]))
    [r3] = after.result(30)
    assert r3.finish_reason == "length"
    assert r3.prompt_logprobs == [None] + [Logprob(t, -1.0, [(5, -0.5)], 2) for t in (5, 9, 33)]


def test_prompt_logprobs_a_request_did_not_ask_for_fail_it(router):
    """A worker that sends prompt logprobs to a request without prompt_logprobs ends it with an error."""
    client, w = router
    fut = _ask(client, [1, 5], max_new_tokens=2)
    add = w.recv(P.AddRequest)
    w.send(P.StepTokens(req_ids=[add.req_id], token_ids=[8], finish_reasons=[None], cached_tokens=[0], logprobs=None, prompt_logprobs=[pack([(-1.0, [])], 0)]))
    assert w.recv(P.AbortRequest).req_id == add.req_id
    [r] = fut.result(30)
    assert r.finish_reason == "error" and "malformed logprobs" in r.error


def test_sampled_logprobs_reach_the_client_with_their_rank(router):
    """A sampled token's logprob, alternatives and rank arrive as a Logprob, with the texts of the token and
    its alternatives (the router's tokenizer); a rank the worker does not know (None) stays None."""
    client, w = router
    fut = _ask(client, [1, 5], max_new_tokens=2, logprobs=1)
    add = w.recv(P.AddRequest)
    w.send(P.StepTokens(req_ids=[add.req_id], token_ids=[8], finish_reasons=[None], cached_tokens=[0], logprobs=[[-0.25, [[8, -0.25]], 1]]))
    w.send(P.StepTokens(req_ids=[add.req_id], token_ids=[9], finish_reasons=["length"], cached_tokens=[0], logprobs=[[-3.5, [[8, -0.5]], None]]))
    [r] = fut.result(30)
    assert r.token_ids == [8, 9]
    assert r.logprobs == [Logprob(8, -0.25, [(8, -0.25)], 1), Logprob(9, -3.5, [(8, -0.5)], None)]
    assert r.logprobs[0].to_dict()["rank"] == 1 and "rank" not in r.logprobs[1].to_dict()
    assert [(x.text, x.token_bytes, x.top_texts) for x in r.logprobs] == [("w8", b"w8", ["w8"]), ("w9", b"w9", ["w8"])]


@pytest.mark.parametrize("bad", [[float("inf"), [], 1], [-1.0, [[9, -0.5], [8, -1.0]], 1], [-1.0, [[-1, -0.5]], 1],
                                 [-1.0, [], 0], [-1.0, [], 321], [-1.0, [], 2.0], [-1.0, []]],
                         ids=["inf", "too many", "bad id", "rank 0", "rank past the vocabulary", "float rank",
                              "no rank"])
def test_malformed_sampled_logprobs_fail_the_request(router, bad):
    """The sampled token's logprobs are checked the same way (finite, at most n alternatives, token ids, a
    rank in 1 … vocabulary)."""
    client, w = router
    fut = _ask(client, [1, 5], max_new_tokens=2, logprobs=1)
    add = w.recv(P.AddRequest)
    w.send(P.StepTokens(req_ids=[add.req_id], token_ids=[8], finish_reasons=[None], cached_tokens=[0], logprobs=[bad]))
    assert w.recv(P.AbortRequest).req_id == add.req_id
    [r] = fut.result(30)
    assert r.finish_reason == "error" and "malformed logprobs" in r.error


def test_prompt_logprobs_too_big_for_a_frame_are_refused(router):
    """A prompt whose logprobs could not travel in one frame (here 40,000 tokens × 20 alternatives, 6.4 MiB
    packed) is refused at once naming prompt_logprobs; with 1 alternative the same prompt is admitted."""
    client, w = router
    prompt = [1] + [5] * 39_999
    with pytest.raises(mii_async.RequestTooLongError) as e:
        _ask(client, prompt, max_new_tokens=1, prompt_logprobs=20).result(30)
    assert e.value.param == "prompt_logprobs"
    assert prompt_logprobs_bytes(len(prompt), 20) > P.MAX_PROMPT_LOGPROBS_BYTES
    fut = _ask(client, prompt, max_new_tokens=1, prompt_logprobs=1)
    add = w.recv(P.AddRequest)
    plps = pack([(-2.0, [(5, -0.125)])] * (len(prompt) - 1), 1)
    w.send(P.StepTokens(req_ids=[add.req_id], token_ids=[5], finish_reasons=["length"], cached_tokens=[0], logprobs=None, prompt_logprobs=[plps]))
    [r] = fut.result(60)
    assert len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[-1] == Logprob(5, -2.0, [(5, -0.125)], 2)


@pytest.mark.parametrize("info", [{k: v for k, v in LIMITS.items() if k != "max_model_len"},
                                  {**LIMITS, "vocab_size": "320"}, {**LIMITS, "max_request_tokens": 0}])
def test_a_malformed_ready_fails_that_worker_not_the_router(router, info):
    """A worker whose Ready lacks a limit (or gives one that is not a positive integer) is told to shut down and
    its replica is failed; the router still answers health, and the good replica still serves."""
    client, worker = router
    rogue = ScriptedWorker(client.run(client.health())["worker_address"], client.curve_dir, info=info,
                           tag=f"rogue-{len(info)}")
    try:
        rogue.recv(P.Shutdown)

        async def gone():
            h = await client.health()
            return all(r["replica"] != rogue.replica or r["state"] != "ready" for r in h["replicas"])
        client.run(until(gone, 30, "the rogue replica to be failed"))
        h = client.run(client.health())
        assert [r["state"] for r in h["replicas"] if r["replica"] == worker.replica] == ["ready"]
        assert h["limits"]["max_model_len"] == LIMITS["max_model_len"]
    finally:
        rogue.close()
