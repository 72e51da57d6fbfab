"""AsyncClient lifecycles under stress, against a real deployment of a tiny model: closing with streams open,
many clients opened and closed, use after close, frames too large for the wire or malformed."""
from __future__ import annotations

import asyncio
import gc
import os
import threading
import time

import msgpack
import pytest
import zmq

import mii_async
from mii_async import protocol as P
from tests.mesh_helpers import deployment_pids, kv_idle, raw_dealer, until, wait_gone, with_word_tokenizer

LONG = dict(max_new_tokens=900, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_deployment(tiny_model, tmp_path_factory):
    """A router and one worker of a tiny random model; clients that go silent keep their requests for 60 s, so
    that only an explicit abort frees them within the tests' bounds."""
    path = with_word_tokenizer(tiny_model("llama"), tmp_path_factory.mktemp("stress") / "tiny")
    client = mii_async.serve(str(path), num_blocks=256, client_timeout_s=60.0)
    pids = [client._process.pid] + deployment_pids(client.run(client.health()))
    yield client
    client.terminate_server_sync(drain_s=0)
    assert not wait_gone(pids), "processes left behind"


async def _router_idle(server, timeout_s: float) -> None:
    async def idle() -> bool:
        return (await server.health())["live_requests"] == 0
    await until(idle, timeout_s, "the router to forget every request")
    await kv_idle(server, timeout_s)


def _in_thread(fn, timeout_s: float):
    """fn() on a thread, bounded: ("hang", None) when it does not return in time."""
    out: list = []

    def target() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(("raised", exc))

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    return out[0] if out else ("hang", None)


def test_use_after_close_raises_instead_of_hanging(tiny_deployment):
    """After close() (twice: idempotent), the sync facade and run() raise EngineClosedError at once instead of
    waiting for ever on the stopped loop; so does an async call."""
    c = mii_async.client(tiny_deployment.address, timeout_s=10)
    assert c([[1, 5, 9]], max_new_tokens=2)[0].generated_length == 2
    c.close()
    c.close()
    time.sleep(0.8)                                 # the loop thread has stopped by now
    kind, exc = _in_thread(lambda: c([[1, 5, 9]], max_new_tokens=2), 5.0)
    assert kind == "raised" and isinstance(exc, mii_async.EngineClosedError), (kind, exc)
    kind, exc = _in_thread(lambda: c.run(c.health()), 5.0)
    assert kind == "raised" and isinstance(exc, mii_async.EngineClosedError), (kind, exc)
    with pytest.raises(mii_async.EngineClosedError):
        async def closed_generate():
            return await c.generate([[1, 5, 9]], max_new_tokens=2)
        asyncio.run(closed_generate())


def test_closed_clients_release_their_descriptors(tiny_deployment):
    """Clients opened, used and closed one after another (sync facade, asyncio.run) hold no file descriptors
    afterwards, without waiting for the garbage collector: a script that makes one per job does not reach
    `ulimit -n`."""
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    gc.collect()
    before = fds()
    gc.disable()                                    # closing must free them, not the collector
    try:
        for i in range(30):
            c = mii_async.client(tiny_deployment.address, timeout_s=10)
            assert c([[1, 5, i]], max_new_tokens=1)[0].generated_length == 1
            c.close()
            c = mii_async.client(tiny_deployment.address, timeout_s=10)
            async def one(c=c, i=i):
                return await c.generate([[1, 6, i]], max_new_tokens=1)
            asyncio.run(one())
            c.close()
        deadline = time.monotonic() + 30.0
        while fds() > before + 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert fds() <= before + 8, f"{fds() - before} descriptors still open after 60 clients were closed"
    finally:
        gc.enable()


def test_close_aborts_the_streams_it_leaves(tiny_deployment):
    """close() with streams still open — on the same loop, or on the sync facade's from other threads — ends
    them with UnavailableError and aborts them at the router: its requests and their KV blocks are gone within
    3 s, not after client_timeout_s (60 s here) or max_new_tokens."""
    async def on_loop() -> None:
        c = mii_async.client(tiny_deployment.address, timeout_s=10)
        seen: list[int] = []

        async def consume(i: int) -> None:
            async for _ in c.stream([1, 5, 9, i], **LONG):
                seen.append(i)

        tasks = [asyncio.create_task(consume(i)) for i in range(4)]
        await until(lambda: _at_least(seen, 8), 30, "the streams to start")
        c.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, mii_async.UnavailableError) for r in results), results
        await _router_idle(tiny_deployment, 30.0)

    asyncio.run(on_loop())

    c = mii_async.client(tiny_deployment.address, timeout_s=10)
    outcomes: list = []

    def stream(i: int) -> None:
        try:
            outcomes.append(c([[1, 7, i]], **LONG))
        except mii_async.UnavailableError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()

    async def running() -> bool:
        return (await tiny_deployment.stats())["running"] == 4
    asyncio.run(until(running, 30, "4 requests running"))
    c.close()
    for t in threads:
        t.join(10)
    assert len(outcomes) == 4 and all(isinstance(o, mii_async.UnavailableError) for o in outcomes), outcomes
    asyncio.run(_router_idle(tiny_deployment, 30.0))


async def _at_least(seen: list, n: int) -> bool:
    return len(seen) >= n


def test_a_frame_too_large_is_refused_before_it_is_sent(tiny_deployment):
    """A prompt whose frame exceeds the 16 MiB limit raises RequestTooLongError naming it at once, instead of
    making the router's socket drop the client's connection (losing the deltas of its other streams, and this
    request with a misleading "restarted" after a few seconds); a stream running beside it loses nothing."""
    async def main() -> None:
        c = mii_async.client(tiny_deployment.address, timeout_s=10)
        try:
            other = asyncio.create_task(c.generate([[1, 5, 11]], max_new_tokens=200, ignore_eos=True))
            await asyncio.sleep(0.2)
            for prompt, param in (("word " * (4 << 20), "prompt"), ([1] * (5 << 20), "prompt"),
                                  ([{"role": "user", "content": "x" * (17 << 20)}], "messages")):
                with pytest.raises(mii_async.RequestTooLongError, match="MiB") as e:
                    await c.generate([prompt], max_new_tokens=2)
                assert e.value.param == param
            # Sent, any of them would have made the router drop this client's connection: `other` would end
            # with "restarted" instead of its 200 tokens.
            [r] = await other
            assert r.finish_reason == "length" and r.generated_length == len(r.token_ids) == 200
            assert r.usage.completion_tokens == 200
        finally:
            c.close()
        await _router_idle(tiny_deployment, 30.0)

    asyncio.run(main())


def test_a_malformed_generate_is_answered_under_its_id(tiny_deployment):
    """A Generate frame that fails to decode (a map key that is not a string) is answered with a bad_frame
    ErrorReply under its req_id, so its stream ends at once; a malformed Abort is answered without one (a
    reply under its id would end the live request it names). Through AsyncClient, a chat message with such a
    key is refused naming it."""
    with pytest.raises(mii_async.InvalidParameterError) as e:
        tiny_deployment([[{"role": "user", "content": "hi", 1: 2}]], max_new_tokens=2)
    assert e.value.param == "messages[0]"
    ctx = zmq.Context()
    s = raw_dealer(ctx, tiny_deployment.address)
    s.connect(tiny_deployment.address)
    try:
        for kind, want in (("Generate", "g-1"), ("Query", "q-1"), ("Abort", None)):
            frame = {"v": P.PROTOCOL_VERSION, "t": kind, "req_id": want or "a-1", "params": {1: 2}}
            s.send(msgpack.packb(frame))
            assert s.poll(5000), f"no answer to a malformed {kind}"
            reply = P.decode(s.recv())
            assert isinstance(reply, P.ErrorReply) and reply.code == "bad_frame" and reply.req_id == want
    finally:
        s.close()
        ctx.term()


def test_streams_given_up_on_a_stalled_router_are_aborted_there(tiny_deployment):
    """A router that stalls past the client's timeout_s (SIGSTOP here; an overloaded host alike) fails the
    streams with UnavailableError; once it runs again it is told to abort them, instead of generating to
    max_new_tokens for a client that is still connected (and pinging, so never expired) but gave up."""
    import signal

    router = tiny_deployment._process.pid

    async def main() -> None:
        c = mii_async.client(tiny_deployment.address, timeout_s=2.0)
        c.ping_s = 0.5
        seen: list[int] = []

        async def consume(i: int) -> None:
            async for _ in c.stream([1, 6, i], **LONG):
                seen.append(i)

        try:
            tasks = [asyncio.create_task(consume(i)) for i in range(3)]
            await until(lambda: _at_least(seen, 6), 30, "the streams to start")
            os.kill(router, signal.SIGSTOP)
            try:
                results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
            finally:
                os.kill(router, signal.SIGCONT)
            assert all(isinstance(r, mii_async.UnavailableError) for r in results), results
            [r] = await c.generate([[1, 2, 3]], max_new_tokens=2)        # the client lives on
            assert r.generated_length == 2
            await _router_idle(tiny_deployment, 30.0)
        finally:
            c.close()

    asyncio.run(main())


def test_a_duplicate_req_id_is_refused_without_ending_the_live_stream(tiny_deployment):
    """A raw client that reuses the id of a live request gets an invalid_parameter ErrorReply naming req_id,
    sent under no id: under the live one it would end that stream, which must run on to its last token."""
    ctx = zmq.Context()
    s = raw_dealer(ctx, tiny_deployment.address)
    s.connect(tiny_deployment.address)
    try:
        s.send(P.encode(P.Generate(req_id="dup", prompt="a b c", params=dict(max_new_tokens=40, ignore_eos=True))))
        first = P.decode(s.recv()) if s.poll(30000) else None
        assert isinstance(first, (P.Delta, P.DeltaBatch)), first
        s.send(P.encode(P.Generate(req_id="dup", prompt="a b c", params=dict(max_new_tokens=2))))
        refused, ends = None, []
        deadline = time.monotonic() + 60
        while not ends and time.monotonic() < deadline:
            assert s.poll(10000), "the live stream stopped"
            msg = P.decode(s.recv())
            if isinstance(msg, P.ErrorReply):
                refused = msg
                continue
            for d in msg.deltas if isinstance(msg, P.DeltaBatch) else [msg]:
                assert d.req_id == "dup"
                if d.finish_reason is not None:
                    ends.append(d)
        assert refused is not None and refused.req_id is None and refused.param == "req_id", refused
        assert ends and ends[0].finish_reason == "length" and ends[0].usage["completion_tokens"] == 40, ends
    finally:
        s.close()
        ctx.term()
