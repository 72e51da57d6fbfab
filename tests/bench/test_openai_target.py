"""OpenAITarget against a small OpenAI-style server in this process (a real socket on 127.0.0.1): a server's own
fields reach every request body, `reuse_connections=False` opens a connection per request, and a stream that
carries no usage is counted from its finish reason."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

from mii_async.bench.targets import OpenAITarget, RequestRecord, sampling
from mii_async.bench.workload import BenchRequest


class _Handler(BaseHTTPRequestHandler):
    """GET /v1/models; POST /v1/completions answers the SSE events of the server's `script` for the prompt."""

    protocol_version = "HTTP/1.1"          # keep-alive, so that connection reuse is the client's choice

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(json.dumps({"data": [{"id": "tiny"}]}).encode(), "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append({"body": body, "client_port": self.client_address[1]})
        events = self.server.script[body["prompt"]]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(sse.encode(), "text/event-stream")


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


SCRIPT = {
    # No usage: ends on "length" after 3 text chunks (a server that streams several tokens per chunk).
    "length no usage": [_chunk(" a b"), _chunk(" c"), _chunk(" d e", "length")],
    # No usage: ends on "stop" (an end token) after 2 text chunks.
    "stop no usage": [_chunk(" a"), _chunk(" b"), _chunk("", "stop")],
    # Usage streamed: the server's own count stands.
    "with usage": [_chunk(" a"), _chunk(" b", "length"),
                   {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                             "prompt_tokens_details": {"cached_tokens": 1}}}],
}


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.seen, srv.script = [], SCRIPT
    thread = threading.Thread(target=srv.serve_forever, name="openai-test-server", daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(30.0)


def _run(srv: ThreadingHTTPServer, prompts: list[str], max_tokens: int, **target: Any) -> list[RequestRecord]:
    async def go() -> list[RequestRecord]:
        t = OpenAITarget(f"http://127.0.0.1:{srv.server_address[1]}/v1", **target)
        try:
            assert (await t.open()) == {"model": "tiny"}
            return [await t.send(BenchRequest(p, 4, max_tokens), sampling(BenchRequest(p, 4, max_tokens),
                                                                       True, 0.0)) for p in prompts]
        finally:
            await t.close()

    return asyncio.run(asyncio.wait_for(go(), 60.0))


def test_extra_body_reaches_every_request_and_overrides(server):
    _run(server, ["with usage", "with usage"], 2, extra_body={"repeat_penalty": 1.0, "n_predict": 9,
                                                              "temperature": 0.5})
    assert len(server.seen) == 2
    for s in server.seen:
        b = s["body"]
        assert b["repeat_penalty"] == 1.0 and b["n_predict"] == 9
        assert b["temperature"] == 0.5                         # the server's own value wins over the bench's 0.0
        assert b["max_tokens"] == 2 and b["min_tokens"] == 2 and b["ignore_eos"] is True
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True} and b["model"] == "tiny"


def test_no_extra_body_sends_only_the_openai_fields(server):
    _run(server, ["with usage"], 2)
    assert set(server.seen[0]["body"]) == {"model", "prompt", "max_tokens", "min_tokens", "temperature",
                                           "ignore_eos", "stream", "stream_options"}


def test_reuse_connections_false_opens_one_connection_per_request(server):
    _run(server, ["with usage"] * 3, 2, reuse_connections=False)
    ports = [s["client_port"] for s in server.seen]
    assert len(ports) == 3 and len(set(ports)) == 3, ports


def test_reuse_connections_default_keeps_one_connection(server):
    _run(server, ["with usage"] * 3, 2)
    ports = [s["client_port"] for s in server.seen]
    assert len(ports) == 3 and len(set(ports)) == 1, ports


def test_stream_without_usage_ending_on_length_counts_max_tokens(server):
    (rec,) = _run(server, ["length no usage"], 7)
    assert rec.ok, rec.error
    assert rec.output_tokens == 7                              # max_tokens, not the 3 chunks
    assert len(rec.chunk_times) == 3 and rec.prompt_len == 4 and rec.cached_tokens is None


def test_stream_without_usage_ending_on_stop_counts_chunks(server):
    (rec,) = _run(server, ["stop no usage"], 7)
    assert rec.ok, rec.error
    assert rec.output_tokens == 2 == len(rec.chunk_times)      # the text chunks, one token each


def test_streamed_usage_is_the_count(server):
    (rec,) = _run(server, ["with usage"], 7)
    assert rec.ok, rec.error
    assert rec.output_tokens == 2 and rec.prompt_len == 5 and rec.cached_tokens == 1
