"""Replicas, worker death and shutdown, with real processes: kill -9 a worker, drain, lose the parent."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import mii_async
from mii_async import protocol as P
from tests.mesh_helpers import alive, deployment_pids, kv_idle, until, wait_gone, with_word_tokenizer

pytestmark = pytest.mark.slow
LONG = dict(max_new_tokens=120, ignore_eos=True)


async def _collect(client, prompt, **kw):
    chunks = []
    async for c in client.stream(prompt, **kw):
        chunks.append(c)
    return chunks, time.monotonic()


def test_two_replicas_kill9_recovery_and_graceful_stop(default_model_dir):
    """Requests spread over 2 replicas; kill -9 of one worker ends its streams with an error within 5 s while
    the other replica's streams go on, new requests go to the healthy replica, a replacement starts and serves;
    terminate_server drains then aborts, and every process exits."""
    client = mii_async.serve(str(default_model_dir), replicas=2, kv_cache_memory=0.1)
    router_pid = client._process.pid
    all_pids = {router_pid}
    try:
        async def main():
            h = await client.health()
            assert [r["state"] for r in h["replicas"]] == ["ready", "ready"]
            all_pids.update(deployment_pids(h))
            tasks = [asyncio.create_task(_collect(client, f"Story number {i}:", **LONG)) for i in range(4)]
            h = await until(lambda: _spread(client), 30, "requests on both replicas")
            victim = h["replicas"][0]["pids"][0]
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            done, pending = await asyncio.wait(tasks, timeout=5.0)
            errors = [t.result() for t in done]
            assert len(errors) == 2 and len(pending) == 2
            for chunks, t in errors:
                last = chunks[-1]
                assert last.finish_reason == "error" and t - killed_at < 5.0
                assert "replica 0" in last.error and "SIGKILL" in last.error
            # Replica 0 is known dead: new requests go to replica 1 while it is replaced.
            assert (await client.health())["replica_deaths"] == 1
            [r] = await client.generate("The capital of France is", max_new_tokens=4)
            assert r.finish_reason == "length"
            for chunks, _ in await asyncio.gather(*pending):
                assert chunks[-1].finish_reason == "length" and len(chunks) == LONG["max_new_tokens"]
            h = await until(lambda: _replaced(client), 120, "the replacement replica")
            all_pids.update(deployment_pids(h))
            assert not alive(victim)
            [r] = await client.generate("The capital of France is", max_new_tokens=4)
            assert r.finish_reason == "length"
            await kv_idle(client)
            # Graceful stop: live requests get drain_s, then end with "abort".
            tasks = [asyncio.create_task(_collect(client, f"Another story {i}:", **LONG)) for i in range(2)]
            await until(lambda: _used(client), 30, "live requests")
            t0 = time.monotonic()
            await client.terminate_server(drain_s=1.0)
            ended = await asyncio.gather(*tasks)
            assert all(c[-1].finish_reason == "abort" for c, _ in ended)
            assert all(t - t0 < 5.0 for _, t in ended)
        asyncio.run(main())
    finally:
        if client._process.child.poll() is None:
            client.terminate_server_sync(drain_s=0)
    assert not wait_gone(sorted(all_pids)), "processes left behind"


async def _spread(client):
    h = await client.health()
    return h if all(r["requests"] >= 1 for r in h["replicas"]) else None


async def _replaced(client):
    h = await client.health()
    r0 = h["replicas"][0]
    return h if r0["state"] == "ready" and r0["generation"] == 1 else None


async def _used(client):
    return (await client.stats())["used_blocks"]   # 0 while the replica is unanswered


def test_parent_death_stops_the_deployment(default_model_dir, tmp_path):
    """kill -9 of the process that called serve(): the router and its workers exit, no orphan is left."""
    script = textwrap.dedent(f"""
        import json, sys, time, mii_async
        c = mii_async.serve({str(default_model_dir)!r}, kv_cache_memory=0.1)
        h = c.run(c.health())
        print(json.dumps([c._process.pid] + [p for r in h["replicas"] for p in r["pids"]]), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 2 and all(alive(p) for p in pids)
        proc.kill()
        proc.wait()
        assert not wait_gone(pids, timeout_s=60), "orphans after the parent died"
    finally:
        proc.kill()


def test_tensor_parallel_replicas_and_rank_death(tiny_model, tmp_path):
    """serve(replicas=2, tensor_parallel=2) streams what the in-process engine gives; kill -9 of a non-leader
    rank fails its replica's requests within 5 s and the replica is replaced; every process exits."""
    path = with_word_tokenizer(tiny_model("llama"), tmp_path / "tiny")
    prompts = [[1, 5, 9, 33, 70, 12, 8], [1, 200, 3, 4], [1, 17, 17, 250, 31, 99]]
    with mii_async.pipeline(str(path), num_blocks=64) as pipe:
        want = [r.token_ids for r in pipe(prompts, max_new_tokens=16, ignore_eos=True)]
    client = mii_async.serve(str(path), replicas=2, tensor_parallel=2, num_blocks=64)
    all_pids = {client._process.pid}
    try:
        async def main():
            h = await client.health()
            all_pids.update(deployment_pids(h))
            assert [len(r["pids"]) for r in h["replicas"]] == [2, 2]
            got = await client.generate(prompts, max_new_tokens=16, ignore_eos=True)
            assert [r.token_ids for r in got] == want
            tasks = [asyncio.create_task(_collect(client, [1, 2, 3, i + 4], max_new_tokens=900, ignore_eos=True))
                     for i in range(4)]
            h = await until(lambda: _spread(client), 30, "requests on both replicas")
            victim = h["replicas"][0]["pids"][1]                  # rank 1 of replica 0
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            done, pending = await asyncio.wait(tasks, timeout=5.0)
            assert len(done) == 2
            for t in done:
                chunks, at = t.result()
                assert chunks[-1].finish_reason == "error" and at - killed_at < 5.0
            for t in pending:
                t.cancel()
            h = await until(lambda: _replaced(client), 120, "the replacement replica")
            all_pids.update(deployment_pids(h))
            got = await client.generate(prompts, max_new_tokens=16, ignore_eos=True)
            assert [r.token_ids for r in got] == want
        asyncio.run(main())
    finally:
        client.terminate_server_sync(drain_s=0)
    assert not wait_gone(sorted(all_pids)), "processes left behind"


def test_impossible_tensor_parallel_is_refused(default_model_dir):
    """A tensor_parallel the model's heads do not allow fails serve() at once, naming the heads."""
    with pytest.raises(mii_async.InvalidParameterError, match="9 attention heads") as e:
        mii_async.serve(str(default_model_dir), tensor_parallel=2)
    assert e.value.param == "tensor_parallel"


def test_a_silent_replica_fails_the_prefix_cache_reset(tiny_model, tmp_path):
    """A replica that stops answering (SIGSTOP, inside its heartbeat timeout) makes reset_prefix_cache an
    UnavailableError naming it, not a partial success; stats() lists it as unanswered. Once it runs again,
    both answer in full."""
    path = with_word_tokenizer(tiny_model("llama"), tmp_path / "tiny")
    client = mii_async.serve(str(path), replicas=2, num_blocks=64, heartbeat_timeout_s=120.0)
    pids: list[int] = []
    try:
        async def main():
            h = await client.health()
            pids.extend(deployment_pids(h))
            victim = h["replicas"][1]["pids"][0]
            assert (await client.stats())["unanswered"] == []
            os.kill(victim, signal.SIGSTOP)
            try:
                s = await client.stats()          # replica 0's counters alone, every key there
                assert s["unanswered"] == [1] and list(s["replicas"]) == ["0"]
                assert set(P.ENGINE_COUNTERS) <= set(s) and s["num_blocks"] == 64
                t0 = time.monotonic()
                with pytest.raises(mii_async.UnavailableError, match="replica 1 did not answer"):
                    await client.reset_prefix_cache()
                assert time.monotonic() - t0 < 30
            finally:
                os.kill(victim, signal.SIGCONT)
            r = await client.reset_prefix_cache()
            assert sorted(r["replicas"]) == ["0", "1"] and r["unanswered"] == []
        asyncio.run(main())
    finally:
        client.terminate_server_sync(drain_s=0)
    assert not wait_gone([client._process.pid, *pids]), "processes left behind"


def test_a_router_restarted_on_the_same_address_fails_the_requests_it_lost(default_model_dir):
    """kill -9 of the router mid-stream, and a new one on the same ports: it answers pings but never heard of
    the stream, which ends with UnavailableError naming the restart (the pings carry the router's life), not a
    wait without end; the client then serves on the new router."""
    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port, worker_port = free_port(), free_port()

    def start() -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "mii_async", "serve", str(default_model_dir), "--no-http",
                              "--port", str(port), "--worker-port", str(worker_port), "--kv-cache-memory", "0.1"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert p.stdout.readline().startswith("mii-async: serving")
        return p

    first = start()
    second = None
    client = mii_async.client(f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        async def main():
            chunks = []

            async def consume():
                async for c in client.stream("Tell me a long story.", max_new_tokens=2000, ignore_eos=True):
                    chunks.append(c)

            task = asyncio.create_task(consume())
            async def streaming() -> bool:
                return len(chunks) >= 3

            await until(streaming, 60, "the stream to start")
            nonlocal second
            first.kill()
            first.wait()
            second = await asyncio.get_running_loop().run_in_executor(None, start)
            with pytest.raises(mii_async.UnavailableError, match="restarted"):
                await asyncio.wait_for(task, 30)         # found by the next pings, not the 60 s timeout
            [r] = await client.generate(["What is the capital of France?"], max_new_tokens=4)
            return r

        assert asyncio.run(main()).generated_length >= 1
    finally:
        client.close()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
