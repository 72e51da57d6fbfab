"""AsyncClient against a real deployment of the default model: a router process and a worker process."""
from __future__ import annotations

import asyncio
import time

import pytest

import mii_async
from mii_async import InvalidParameterError, OverloadedError, RequestTooLongError
from mii_async.outputs import FinishReason
from tests.mesh_helpers import kv_idle, raw_dealer, until, wait_gone, deployment_pids

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_sync_facade_answers_paris(deployment):
    """The synchronous facade returns Responses; the default model answers the capital question."""
    [r] = deployment([QUESTION], max_new_tokens=12)
    assert "Paris" in r.generated_text
    assert r.finish_reason == "stop" and r.generated_length == len(r.token_ids) == r.usage.completion_tokens
    assert r.prompt_length == len(r.prompt_token_ids) > 0


def test_64_concurrent_streams_equal_generate(deployment):
    """64 concurrent streams: each one's concatenated deltas equal `generate` for the same seed."""
    prompts = [f"Write a sentence about the number {i}." for i in range(64)]
    params = [dict(max_new_tokens=12, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(64)]

    async def one_stream(p, kw):
        text, ids, last = [], [], None
        async for chunk in deployment.stream(p, **kw):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            last = chunk
        return "".join(text), ids, last

    async def main():
        streamed = await asyncio.gather(*(one_stream(p, kw) for p, kw in zip(prompts, params)))
        generated = await asyncio.gather(*(deployment.generate(p, **kw) for p, kw in zip(prompts, params)))
        return streamed, [g[0] for g in generated]

    streamed, generated = asyncio.run(main())
    for (text, ids, last), resp in zip(streamed, generated):
        assert last.finish_reason in ("stop", "length") and last.usage.completion_tokens == len(ids)
        assert ids == resp.token_ids
        assert text == resp.generated_text
        assert "\ufffd" not in text


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_again(deployment):
    """A repeated prompt comes from the prefix cache; after reset_prefix_cache it is computed again (0 cached
    tokens), with the same greedy tokens."""
    prompt = [1] + [(37 * i) % 4000 + 100 for i in range(70)]
    first = deployment([prompt], max_new_tokens=4)[0]
    again = deployment([prompt], max_new_tokens=4)[0]
    assert again.usage.cached_tokens == 64 and again.token_ids == first.token_ids
    reset = deployment.run(deployment.reset_prefix_cache())
    assert reset["prefix_blocks_forgotten"] >= 4 and reset["replicas"]["0"]["cached_blocks"] == 0
    cold = deployment([prompt], max_new_tokens=4)[0]
    assert cold.usage.cached_tokens == 0 and cold.token_ids == first.token_ids


def test_remote_equals_local_pipeline(deployment, default_pipe):
    """Through the mesh, text, tokens, logprobs (with their tokens' texts, the router's on one side, the
    pipeline's on the other), finish reasons and stop strings are what the in-process pipeline gives."""
    prompts = ["The capital of France is", "List three colours:"]
    kw = dict(max_new_tokens=20, logprobs=2, stop=[" and", "\n\n"])
    remote = deployment(prompts, **kw)
    local = default_pipe(prompts, **kw)
    for r, l in zip(remote, local):
        assert (r.generated_text, r.token_ids, r.finish_reason) == (l.generated_text, l.token_ids, l.finish_reason)
        assert [x.token_id for x in r.logprobs] == [x.token_id for x in l.logprobs]
        for a, b in zip(r.logprobs, l.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.rank == b.rank == 1                  # greedy: each token the most likely
            assert (a.text, a.top_texts, a.top_bytes) == (b.text, b.top_texts, b.top_bytes) and a.text is not None
        assert type(r.finish_reason) is type(l.finish_reason) is FinishReason
    # return_full_text: a text prompt goes before the answer, a chat's messages do not (on both sides)
    for prompt in ("The capital of France is", QUESTION):
        [plain] = default_pipe([prompt], max_new_tokens=4)
        [r] = deployment([prompt], max_new_tokens=4, return_full_text=True)
        [l] = default_pipe([prompt], max_new_tokens=4, return_full_text=True)
        assert r.generated_text == l.generated_text == (prompt if isinstance(prompt, str) else "") + plain.generated_text


def test_leaving_the_loop_early_frees_kv(deployment):
    """Breaking out of a stream (and cancelling a task) aborts the request: KV blocks return to baseline."""
    async def main():
        await kv_idle(deployment)
        agen = deployment.stream("Count from one to one thousand:", max_new_tokens=400, ignore_eos=True)
        n = 0
        async for _ in agen:
            n += 1
            if n == 3:
                break
        await agen.aclose()
        await kv_idle(deployment)

        async def consume():
            async for _ in deployment.stream("Tell me a long story.", max_new_tokens=400, ignore_eos=True):
                pass
        task = asyncio.create_task(consume())
        await until(lambda: _used(deployment), 10, "the request to hold KV blocks")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        t0 = time.monotonic()
        await kv_idle(deployment)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 5


def test_interrupting_the_sync_facade_aborts_its_request(deployment):
    """Ctrl-C in `client(...)` cancels its coroutine on the client's loop, so the request is aborted at the
    router and its KV blocks come back, instead of running on to max_new_tokens."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    deployment.run(kv_idle(deployment))
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(KeyboardInterrupt):
            deployment(["Tell me a very long story."], max_new_tokens=2000, ignore_eos=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    deployment.run(kv_idle(deployment))
    assert deployment.run(deployment.health())["live_requests"] == 0


async def _used(client) -> int:
    return (await client.stats())["used_blocks"]   # 0 while the replica is unanswered


def test_bad_requests_name_the_parameter(deployment):
    """Bad values are refused with errors naming the parameter, by the client and by the router; the
    deployment keeps serving."""
    async def main():
        with pytest.raises(InvalidParameterError) as e:
            await deployment.generate("hi", temperature=-1)
        assert e.value.param == "temperature"
        with pytest.raises(InvalidParameterError) as e:
            await deployment.generate("hi", max_new_tokenz=3)
        assert e.value.param == "max_new_tokenz"
        with pytest.raises(RequestTooLongError) as e:
            await deployment.generate("hi", max_new_tokens=10**6)
        assert e.value.param == "max_new_tokens"
        with pytest.raises(InvalidParameterError) as e:
            await deployment.generate([[5, 10**7]], max_new_tokens=3)
        assert e.value.param == "prompt"
        with pytest.raises(InvalidParameterError) as e:
            await deployment.generate([[{"role": "user"}]], max_new_tokens=3)
        assert e.value.param == "messages[0]"
        [r] = await deployment.generate("hi", max_new_tokens=2)
        assert r.generated_length == 2
        await kv_idle(deployment)
    asyncio.run(main())


@pytest.fixture(scope="module")
def small(default_model_dir):
    """A deployment with one running sequence at a time, 3 queued requests at most, a 4 s client timeout."""
    client = mii_async.serve(str(default_model_dir), kv_cache_memory=0.1, max_num_seqs=1, max_queued_requests=3,
                             client_timeout_s=4.0)
    pids = [client._process.pid] + deployment_pids(client.run(client.health()))
    yield client
    client.terminate_server_sync(drain_s=0)
    assert not wait_gone(pids), "processes left behind"


def test_cancel_while_queued_and_overload(small):
    """A request cancelled while queued leaves the engine's queue; past max_queued_requests a request is
    refused at once with OverloadedError; afterwards KV is back at baseline and requests succeed."""
    async def long_stream(started: asyncio.Event | None = None):
        async for _ in small.stream("Tell me a very long story.", max_new_tokens=500, ignore_eos=True):
            if started is not None:
                started.set()

    async def main():
        await kv_idle(small)
        started = asyncio.Event()
        a = asyncio.create_task(long_stream(started))
        await asyncio.wait_for(started.wait(), 30)
        b = asyncio.create_task(long_stream())
        await until(lambda: _waiting(small, 1), 10, "a queued request")
        b.cancel()
        await asyncio.gather(b, return_exceptions=True)
        await until(lambda: _waiting(small, 0), 5, "the queued request to leave the queue")
        c = asyncio.create_task(long_stream())
        d = asyncio.create_task(long_stream())
        await until(lambda: _waiting(small, 2), 10, "two queued requests")
        t0 = time.monotonic()
        with pytest.raises(OverloadedError, match="max_queued_requests"):
            await small.generate("one too many", max_new_tokens=2)
        refused_in = time.monotonic() - t0
        for t in (a, c, d):
            t.cancel()
        await asyncio.gather(a, c, d, return_exceptions=True)
        await kv_idle(small)
        [r] = await small.generate("hi", max_new_tokens=2)
        return refused_in, r

    refused_in, r = asyncio.run(main())
    assert refused_in < 1.0 and r.generated_length == 2


async def _waiting(client, n: int) -> bool:
    return (await client.stats()).get("waiting") == n


def test_silent_client_loses_its_requests(small):
    """A client that vanishes without an abort (no pings) has its requests aborted after client_timeout_s."""
    import zmq

    from mii_async import protocol as P

    ctx = zmq.Context()
    s = raw_dealer(ctx, small.address)
    s.connect(small.address)
    s.send(P.encode(P.Generate(req_id="x", prompt="Tell me a long story.", params={"max_new_tokens": 500, "ignore_eos": True})))
    assert s.poll(30_000), "no delta from the router"
    s.close(linger=0)
    ctx.term()

    async def main():
        await until(lambda: _used(small), 5, "the orphaned request to hold KV blocks")
        await kv_idle(small, timeout_s=15)
    asyncio.run(main())


def test_unclosed_client_is_collected_without_blocking():
    """A client dropped without close(), with a socket open, is garbage-collected at once: its finalizer
    closes the sockets before the context (run in a child, as a blocked term() would hang this process)."""
    import subprocess
    import sys

    code = """if True:
        import asyncio, gc, time
        from mii_async.async_client import AsyncClient
        async def main():
            c = AsyncClient("tcp://127.0.0.1:9", timeout_s=0.3)
            try:
                await c.generate("hi", max_new_tokens=1)
            except Exception as exc:
                print(type(exc).__name__)
        asyncio.run(main())
        t = time.perf_counter()
        gc.collect()
        print("collected in", round(time.perf_counter() - t, 2))
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "UnavailableError" in r.stdout and "collected in" in r.stdout


def test_a_cancel_as_the_send_completes_is_not_lost():
    """The client's timed awaits stay cancellable at the instant they complete (Python 3.11's wait_for
    swallows that cancel: a stream cancelled right after sending its request would run to the end)."""
    from mii_async.async_client import within

    async def main():
        inner = asyncio.get_running_loop().create_future()

        async def body():
            await within(inner, 5.0)
            return "ran on"

        task = asyncio.ensure_future(body())
        await asyncio.sleep(0)                    # the task now waits on `inner`
        inner.set_result(None)
        task.cancel()                             # in the same loop turn as the completion
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(main()) == "cancelled"

    async def slow():
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(5), 0.05)

    asyncio.run(slow())


def test_a_silent_router_tells_a_slow_reader_once():
    """A router that answers one token and then goes silent: the stream's reader, busy while the client's
    pings go unanswered past timeout_s, finds one Lost waiting (not one per ping), then UnavailableError. A
    close() right after still sends the stream's Abort (the router may only have stalled)."""
    import zmq.asyncio

    from mii_async import protocol as P
    from mii_async.async_client import AsyncClient
    from mii_async.errors import UnavailableError
    from mii_async.transport import RouterSocket

    async def main():
        ctx = zmq.asyncio.Context()
        router = RouterSocket(ctx, "tcp://127.0.0.1:0")
        client = AsyncClient(router.address, ping_s=0.05, timeout_s=0.3)
        try:
            stream = client.stream("hi", max_new_tokens=8)
            first = asyncio.ensure_future(stream.__anext__())
            got = await router.recv()                 # the Generate; answer one token, then nothing
            assert isinstance(got.message, P.Generate)
            await router.send(got.peer, P.Delta(req_id=got.message.req_id, text="Paris", token_ids=[42]))
            assert (await first).text == "Paris"
            await asyncio.sleep(1.2)                  # ~18 pings' time, all past timeout_s
            (conn,) = client._conns.values()
            queued = list(conn.streams[got.message.req_id]._queue)
            assert len(queued) == 1, queued
            with pytest.raises(UnavailableError, match="has not answered for 0.3 s"):
                await stream.__anext__()
            client.close()                            # at once: the stream's Abort leaves with the socket
            seen = []
            while not any(isinstance(m, P.Abort) for m in seen):
                seen.append((await asyncio.wait_for(router.recv(), 5)).message)
            assert P.Abort(req_id=got.message.req_id) in seen
        finally:
            client.close()
            router.close()
            await asyncio.sleep(0.05)                 # the cancelled reader and pinger finish on this loop
            ctx.term()
    asyncio.run(main())


def test_connection_settings_are_checked_naming_the_parameter():
    """A client's ping period and timeout must be positive seconds: a bad one is refused at construction,
    named, before any socket is made."""
    from mii_async.async_client import AsyncClient

    for kw, param in ((dict(ping_s=0), "ping_s"), (dict(timeout_s=-1.0), "timeout_s"), (dict(timeout_s="5"), "timeout_s")):
        with pytest.raises(InvalidParameterError) as e:
            AsyncClient("tcp://127.0.0.1:9", **kw)
        assert e.value.param == param
