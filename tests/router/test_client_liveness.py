"""The client learns that its router is gone: a closed connection fails open streams at once and refuses new
requests until a router answers on the address again; unanswered pings fail what is outstanding after
liveness_timeout_s. Real routers (a `mii-async serve` process, killed with SIGKILL) and real sockets."""
from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading

import pytest
import zmq.asyncio

import mii_async
from mii_async import protocol as P
from mii_async.async_client import AsyncClient
from mii_async.errors import InvalidParameterError, UnavailableError
from mii_async.transport import RouterSocket
from tests.mesh_helpers import until, wait_gone

# Long enough that no failure below can come from a silence bound: only the closed connection can explain it.
PATIENT = dict(timeout_s=120.0, liveness_timeout_s=120.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_closed_router_socket_fails_streams_and_refuses_requests_until_one_is_back():
    """A router socket that closes mid-stream fails the stream with UnavailableError naming the router, and a
    new request at once without sending it; a router bound again on the same port serves the same client."""
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        address = f"tcp://127.0.0.1:{_free_port()}"
        first = RouterSocket(ctx, address)
        second = None
        client = AsyncClient(address, **PATIENT)
        try:
            stream = client.stream("hi", max_new_tokens=8)
            head = asyncio.ensure_future(stream.__anext__())
            got = await asyncio.wait_for(first.recv(), 30)
            assert isinstance(got.message, P.Generate)
            await first.send(got.peer, P.Delta(req_id=got.message.req_id, text="Paris", token_ids=[42]))
            assert (await asyncio.wait_for(head, 30)).text == "Paris"
            first.close()
            with pytest.raises(UnavailableError, match=f"the router at {address} is not answering"):
                await asyncio.wait_for(stream.__anext__(), 30)
            with pytest.raises(UnavailableError, match="is not answering"):
                await asyncio.wait_for(client.generate("again", max_new_tokens=2), 30)
            with pytest.raises(UnavailableError, match="is not answering"):
                await asyncio.wait_for(client.health(), 30)

            second = RouterSocket(ctx, address)
            (conn,) = client._conns.values()
            await until(lambda: _up(conn), 30, "the client to reconnect")
            answer = asyncio.ensure_future(client.generate("again", max_new_tokens=2))
            # What reaches the new router: the failed stream's Abort (queued while it was gone), then this
            # request; the Generate refused while it was down never went out.
            seen = []
            while not isinstance(seen[-1:] and seen[-1].message, P.Generate):
                seen.append(await asyncio.wait_for(second.recv(), 30))
            assert [type(r.message) for r in seen] == [P.Abort, P.Generate], seen
            req = seen[-1]
            await second.send(req.peer, P.Delta(req_id=req.message.req_id, text="ok", token_ids=[7],
                                                finish_reason="stop", usage={"prompt_tokens": 1,
                                                                             "completion_tokens": 1}))
            [r] = await asyncio.wait_for(answer, 30)
            assert r.generated_text == "ok" and r.finish_reason == "stop"
        finally:
            client.close()
            for s in (first, second):
                if s is not None:
                    s.close()
            await asyncio.sleep(0.05)                 # the client's cancelled tasks finish on this loop
            ctx.term()

    asyncio.run(main())


async def _up(conn) -> bool:
    return conn.down is None


def test_pings_unanswered_for_liveness_timeout_fail_what_is_outstanding():
    """A router that takes requests but never answers (hung, its connection open): the stream fails with
    UnavailableError once pings go unanswered for liveness_timeout_s, well inside a long timeout_s."""
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = RouterSocket(ctx, "tcp://127.0.0.1:0")
        client = AsyncClient(router.address, ping_s=0.05, timeout_s=120.0, liveness_timeout_s=0.5)
        try:
            task = asyncio.ensure_future(client.generate("hi", max_new_tokens=4))
            got = await asyncio.wait_for(router.recv(), 30)
            assert isinstance(got.message, P.Generate)
            with pytest.raises(UnavailableError, match="has not answered for 0.5 s"):
                await asyncio.wait_for(task, 30)
            pings = 0
            while pings == 0:
                msg = (await asyncio.wait_for(router.recv(), 30)).message
                pings += isinstance(msg, P.Query) and msg.what == "ping"
        finally:
            client.close()
            router.close()
            await asyncio.sleep(0.05)
            ctx.term()

    asyncio.run(main())


def test_mark_unavailable_fails_streams_from_another_thread():
    """`mark_unavailable(reason)`, called from a thread other than the streams' loop, fails an open stream
    with that reason, and a later request at once."""
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = RouterSocket(ctx, "tcp://127.0.0.1:0")
        client = AsyncClient(router.address, **PATIENT)
        try:
            stream = client.stream("hi", max_new_tokens=8)
            head = asyncio.ensure_future(stream.__anext__())
            got = await asyncio.wait_for(router.recv(), 30)
            await router.send(got.peer, P.Delta(req_id=got.message.req_id, text="a", token_ids=[1]))
            await asyncio.wait_for(head, 30)
            t = threading.Thread(target=client.mark_unavailable, args=("the deployment stopped",))
            t.start()
            with pytest.raises(UnavailableError, match="the deployment stopped"):
                await asyncio.wait_for(stream.__anext__(), 30)
            t.join(30)
            with pytest.raises(UnavailableError, match="the deployment stopped"):
                await client.generate("again", max_new_tokens=2)
        finally:
            client.close()
            router.close()
            await asyncio.sleep(0.05)
            ctx.term()

    asyncio.run(main())


def test_liveness_timeout_is_checked_naming_it():
    """liveness_timeout_s must be a positive number of seconds: a bad one is refused, named, before any socket."""
    for bad in (0, -1.0, "5", True):
        with pytest.raises(InvalidParameterError) as e:
            AsyncClient("tcp://127.0.0.1:9", liveness_timeout_s=bad)
        assert e.value.param == "liveness_timeout_s"


@pytest.mark.slow
def test_a_killed_router_fails_the_stream_and_a_new_one_serves_the_same_client(default_model_dir, tmp_path):
    """kill -9 of a `mii-async serve` router mid-stream: the stream raises UnavailableError naming the router
    (its closed connection, not a silence bound), a new request is refused the same way; a new router on the
    same ports (the same keys) serves the same client again."""
    keys = str(tmp_path / "keys")
    subprocess.run([sys.executable, "-m", "mii_async", "keys", keys], check=True, capture_output=True, timeout=60)
    port, worker_port = _free_port(), _free_port()
    address = f"tcp://127.0.0.1:{port}"

    def start() -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "mii_async", "serve", str(default_model_dir), "--no-http",
                              "--port", str(port), "--worker-port", str(worker_port), "--kv-cache-memory", "0.1",
                              "--curve-dir", keys], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = p.stdout.readline()
        assert line.startswith("mii-async: serving"), line
        return p

    procs = [start()]
    client = mii_async.client(address, curve_dir=keys, timeout_s=120.0)
    try:
        async def main() -> int:
            first_pids = [procs[0].pid] + [pid for r in (await client.health())["replicas"] for pid in r["pids"]]
            chunks = []

            async def consume() -> None:
                async for c in client.stream("Tell me a long story.", max_new_tokens=2000, ignore_eos=True):
                    chunks.append(c)

            task = asyncio.ensure_future(consume())

            async def streaming() -> bool:
                return len(chunks) >= 2 or task.done()

            await until(streaming, 120, "the stream to start")
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(30)
            with pytest.raises(UnavailableError, match=f"the router at {address} is not answering"):
                await asyncio.wait_for(task, 30)
            with pytest.raises(UnavailableError, match="is not answering"):
                await asyncio.wait_for(client.generate("hi", max_new_tokens=2), 30)
            assert not await asyncio.get_running_loop().run_in_executor(None, wait_gone, first_pids, 30.0), \
                "the killed router's workers live on"

            procs.append(await asyncio.get_running_loop().run_in_executor(None, start))

            async def served() -> int:
                try:
                    [r] = await client.generate(["What is the capital of France?"], max_new_tokens=4)
                except UnavailableError:
                    return 0                      # not reconnected yet
                return r.generated_length

            return await until(served, 120, "the new router to serve this client", period_s=0.5)

        assert asyncio.run(main()) >= 1
    finally:
        client.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(60)
