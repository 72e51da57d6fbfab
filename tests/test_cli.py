"""The `mii-async` command, run as a real process."""
from __future__ import annotations

import os
import subprocess
import sys
import time


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mii_async", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_generate_streams_the_answer(default_model_dir):
    """`mii-async generate` streams the default model's chat answer to stdout."""
    out = _cli("generate", "What is the capital of France?", "--max-new-tokens", "32")
    assert out.returncode == 0, out.stderr
    assert "The capital of France is Paris." in out.stdout


def test_bad_option_is_a_clear_error():
    """A bad sampling option exits 2 with a message naming it, before any model loads."""
    out = _cli("generate", "hi", "--temperature", "-1")
    assert out.returncode == 2 and "temperature" in out.stderr and "loading" not in out.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_with_a_joining_worker_over_curve(default_model_dir, tmp_path, monkeypatch):
    """`mii-async serve --replicas 0` waits for workers; `mii-async worker --router tcp://…` joins it; with
    CURVE keys a client with the keys is served and one without them (another user's: its runtime directory
    holds no keys for the port) is not; SIGTERM stops both processes."""
    import asyncio
    import json
    import signal

    import pytest

    import mii_async
    from mii_async import UnavailableError
    from tests.mesh_helpers import until, wait_gone

    keys = tmp_path / "keys"
    assert _cli("keys", str(keys)).returncode == 0
    again = _cli("keys", str(keys))                   # kept: new keys would lock out those who hold these
    assert again.returncode == 2 and "already holds keys" in again.stderr
    port, wport = _free_port(), _free_port()
    serve = subprocess.Popen([sys.executable, "-m", "mii_async", "serve", str(default_model_dir), "--replicas", "0",
                              "--port", str(port), "--worker-port", str(wport), "--curve-dir", str(keys),
                              "--status-json", "--no-http"], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        line = serve.stdout.readline()
        assert line.startswith("mii-async: serving"), line
        status = json.loads(serve.stdout.readline())
        assert status["address"] == f"tcp://127.0.0.1:{port}"
        worker = subprocess.Popen([sys.executable, "-m", "mii_async", "worker", "--router",
                                   f"tcp://127.0.0.1:{wport}", "--curve-dir", str(keys)])
        client = mii_async.client(status["address"], curve_dir=str(keys))

        async def ready():
            h = await client.health()
            return h if [r["state"] for r in h["replicas"]] == ["ready"] else None

        async def main():
            h = await until(ready, 120, "the joined worker")
            assert h["replicas"][0]["local"] is False and h["replicas"][0]["pids"] == [worker.pid]
            [r] = await client.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                                        max_new_tokens=12)
            assert "Paris" in r.generated_text
            monkeypatch.setenv("MII_ASYNC_RUNTIME_DIR", str(tmp_path / "another-user"))
            stranger = mii_async.client(status["address"], timeout_s=3.0)
            stranger.ping_s = 0.5
            with pytest.raises(UnavailableError):
                await stranger.generate("hi", max_new_tokens=2)
            stranger.close()
        asyncio.run(main())
        client.close()
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
        assert worker.wait(timeout=30) == 0
    finally:
        for p in (serve, worker):
            if p is not None and p.poll() is None:
                p.kill()
    assert not wait_gone([serve.pid, worker.pid])


def test_serve_starts_the_gateway_and_stops_it(default_model_dir):
    """`mii-async serve` starts the gateway (chat page, OpenAI API); it answers; Ctrl-C in its terminal
    (SIGINT to the whole process group) drains: a stream in flight runs to its end, then the router, the
    worker and the gateway stop, leaving no process behind."""
    import json
    import re
    import signal
    import threading

    import httpx

    from tests.mesh_helpers import wait_gone

    serve = subprocess.Popen([sys.executable, "-m", "mii_async", "serve", str(default_model_dir), "--port", "0",
                              "--http-port", "0", "--kv-cache-memory", "0.1", "--max-num-seqs", "8",
                              "--max-batch-tokens", "256", "--max-mixed-batch-tokens", "64", "--drain-timeout", "300"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)        # a terminal's group
    said: list[str] = []                                    # stderr, read whole so that the pipe never fills
    reader = threading.Thread(target=lambda: said.extend(serve.stderr), daemon=True)
    reader.start()
    try:
        assert serve.stdout.readline().startswith("mii-async: serving")
        line = serve.stdout.readline()
        m = re.match(r"mii-async: chat page at (http://127\.0\.0\.1:\d+)/ ", line)
        assert m, line
        url = m.group(1)
        assert "<!doctype html>" in httpx.get(url + "/", timeout=10).text.lower()
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["status"] == "ready"
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
            "temperature": 0})
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 2                     # the worker and the gateway
        started, events = threading.Event(), []

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": "Tell me a story.", "max_tokens": 64, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        os.killpg(serve.pid, signal.SIGINT)           # every process of the group, as Ctrl-C does
        t.join(300)
        assert serve.wait(timeout=300) == 0
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]   # drained, not failed
        assert not wait_gone(children)
        reader.join(10)
        assert not any("gateway exited" in line for line in said), said           # it served the drain
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_serve_refuses_a_busy_http_port_before_loading():
    """A busy --http-port is refused at once, naming it, before any model loads."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = _cli("serve", "--port", "0", "--http-port", str(s.getsockname()[1]))
    assert out.returncode == 2 and "http_port" in out.stderr and "loading" not in out.stderr


def test_serve_names_a_bad_scheduler_option_before_loading():
    """A bad --max-mixed-batch-tokens exits 2 naming it, before any model loads."""
    out = _cli("serve", "--port", "0", "--no-http", "--max-mixed-batch-tokens", "0")
    assert out.returncode == 2 and "max_mixed_batch_tokens" in out.stderr and "loading" not in out.stderr


def test_serve_startup_failures_are_one_line_errors(tmp_path):
    """A busy --port or --worker-port, a missing model and a directory that is no model: exit 2 with a line
    naming the problem, no traceback, no process left behind."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = str(s.getsockname()[1])
        for flag in ("--port", "--worker-port"):
            other = "--worker-port" if flag == "--port" else "--port"
            out = _cli("serve", "--no-http", flag, busy, other, "0")
            assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
            assert f"mii-async: {flag[2:].replace('-', '_')}: cannot listen on" in out.stderr, out.stderr
    (tmp_path / "notes.txt").write_text("not a model")
    for model in (str(tmp_path / "nope"), str(tmp_path)):
        out = _cli("serve", model, "--no-http", "--port", "0")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert any(line.startswith("mii-async: ") for line in out.stderr.splitlines()), out.stderr


def test_serve_restarts_a_gateway_that_dies(default_model_dir):
    """kill -9 of the gateway: `serve` says so and starts a new one on the same port, which answers; the
    deployment then stops cleanly."""
    import re
    import signal

    import httpx

    from tests.mesh_helpers import wait_gone

    import queue
    import threading

    serve = subprocess.Popen([sys.executable, "-m", "mii_async", "serve", str(default_model_dir), "--port", "0",
                              "--http-port", "0", "--kv-cache-memory", "0.1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said: queue.Queue = queue.Queue()                 # its stderr, read whole so that the pipe never fills
    threading.Thread(target=lambda: [said.put(line) for line in serve.stderr], daemon=True).start()
    try:
        assert serve.stdout.readline().startswith("mii-async: serving")
        url = re.match(r"mii-async: chat page at (http://127\.0\.0\.1:\d+)/ ", serve.stdout.readline()).group(1)
        first = int(subprocess.run(["pgrep", "-f", "-P", str(serve.pid), "mii_async.gateway"], capture_output=True,
                                   text=True).stdout.split()[0])
        os.kill(first, signal.SIGKILL)
        while "the gateway exited" not in (line := said.get(timeout=60)):
            pass
        assert "restarting it" in line, line
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "no gateway came back"
            time.sleep(0.3)
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert first not in children and len(children) == 2    # the worker and the new gateway
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=60) == 0
        assert not wait_gone(children)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_a_gateway_that_cannot_come_back_during_a_drain_leaves_the_drain_to_finish(default_model_dir):
    """Ctrl-C starts a drain; the gateway then dies and its port is taken, so it cannot restart. The deployment
    is failing (exit 2), but the drain goes on: a stream sent straight to the router runs to its end."""
    import asyncio
    import queue
    import re
    import signal
    import socket
    import threading

    from mii_async import AsyncClient
    from tests.mesh_helpers import wait_gone

    serve = subprocess.Popen([sys.executable, "-m", "mii_async", "serve", str(default_model_dir), "--port", "0",
                              "--http-port", "0", "--kv-cache-memory", "0.1", "--drain-timeout", "300"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said: queue.Queue = queue.Queue()                 # its stderr, read whole so that the pipe never fills
    threading.Thread(target=lambda: [said.put(line) for line in serve.stderr], daemon=True).start()
    taken = socket.socket()
    try:
        address = re.match(r"mii-async: serving .* on (tcp://\S+) ", serve.stdout.readline()).group(1)
        url = re.match(r"mii-async: chat page at (http://127\.0\.0\.1:\d+)/ ", serve.stdout.readline()).group(1)
        gateway = int(subprocess.run(["pgrep", "-f", "-P", str(serve.pid), "mii_async.gateway"], capture_output=True,
                                     text=True).stdout.split()[0])
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        started, chunks = threading.Event(), []

        async def stream() -> None:
            async with AsyncClient(address.replace("0.0.0.0", "127.0.0.1")) as client:
                async for chunk in client.stream("Tell me a story.", max_new_tokens=48, ignore_eos=True):
                    chunks.append(chunk)
                    started.set()

        t = threading.Thread(target=asyncio.run, args=(stream(),))
        t.start()
        assert started.wait(60)
        serve.send_signal(signal.SIGINT)              # the drain starts
        while "draining" not in said.get(timeout=60):
            pass
        os.kill(gateway, signal.SIGKILL)
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 5
        while True:                                   # before the watcher's restart, 1 s after the death
            try:
                taken.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
                break
            except OSError:                           # the dead gateway's socket is not closed yet
                assert time.monotonic() < deadline
                time.sleep(0.01)
        taken.listen()
        while "the gateway could not restart" not in said.get(timeout=120):
            pass
        t.join(300)
        assert chunks[-1].finish_reason == "length", chunks[-1]   # drained, not cut short
        assert serve.wait(timeout=300) == 2                        # the gateway failed
        assert not wait_gone(children)
    finally:
        taken.close()
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_chat_goes_on_after_a_message_that_does_not_fit(default_model_dir):
    """`mii-async chat` over stdin: a conversation past the context forgets its oldest turn first; a message
    past the context alone is refused with a line naming why; the next turn is answered."""
    long = "word " * 9000
    out = _cli("chat", "--max-new-tokens", "16", stdin=f"Hello\n{long}\nWhat is the capital of France?\n\n")
    assert out.returncode == 0, out.stderr
    assert "oldest turn was forgotten" in out.stderr and "that message was not sent" in out.stderr
    assert "Paris" in out.stdout
