"""Where a benchmark sends its requests, and what it records of each: the router over ZeroMQ (the
AsyncClient), the gateway's OpenAI `/v1/completions` with SSE, or the gateway's WebSocket `/v1/ws`.

Every target streams, so each request's record has the time of every chunk that carried tokens. Times are
`time.perf_counter()` seconds; the runner subtracts the run's start. The output token count is the server's
own (usage); `streamed_tokens` is what the chunks carried, where the protocol says it (router and WebSocket
give the ids of every chunk; OpenAI's completion chunks carry text only).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidParameterError, UnavailableError
from .workload import BenchRequest


@dataclass
class RequestRecord:
    prompt_len: int                  # tokens (the server's count when it reports one)
    output_len_asked: int
    start: float                     # perf_counter() when sent
    end: float = 0.0                 # perf_counter() when the last frame came
    chunk_times: list[float] = field(default_factory=list)   # perf_counter() of each chunk with tokens
    chunk_tokens: list[int] | None = field(default_factory=list)   # tokens per chunk; None: not reported
    output_tokens: int = 0           # the server's completion token count
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache; None: not reported
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def streamed_tokens(self) -> int | None:
        return None if self.chunk_tokens is None else sum(self.chunk_tokens)


def sampling(req: BenchRequest, ignore_eos: bool, temperature: float) -> dict[str, Any]:
    """Our parameters for one request: exactly `output_len` tokens when ignoring EOS."""
    p: dict[str, Any] = {"max_new_tokens": req.output_len, "temperature": temperature, "ignore_eos": ignore_eos}
    if ignore_eos:
        p["min_new_tokens"] = req.output_len
    return p


class RouterTarget:
    """The router's client socket, e.g. tcp://127.0.0.1:5555, through AsyncClient."""

    def __init__(self, address: str, curve_dir: str | None = None, client: Any = None,
                 connect_timeout_s: float = 10.0) -> None:
        from ..async_client import AsyncClient

        self.label = f"router {address}"
        self.timeout_s = connect_timeout_s
        self.client = client or AsyncClient(address, curve_dir=curve_dir, timeout_s=connect_timeout_s)
        self._own = client is None

    async def open(self) -> dict[str, Any]:
        try:
            health = await asyncio.wait_for(self.client.health(), self.timeout_s + 1.0)
        except (asyncio.TimeoutError, UnavailableError, OSError) as exc:
            raise UnavailableError(f"the router at {self.label[7:]} did not answer: {exc or 'timed out'}") from None
        return {"model": health.get("model"), "state": health.get("state")}

    async def send(self, req: BenchRequest, params: dict[str, Any]) -> RequestRecord:
        rec = RequestRecord(req.prompt_len, req.output_len, time.perf_counter())
        try:
            async for c in self.client.stream(req.prompt, **params):
                if c.token_ids:
                    rec.chunk_times.append(time.perf_counter())
                    rec.chunk_tokens.append(len(c.token_ids))
                if c.finish_reason is not None:
                    if c.finish_reason == "error":
                        rec.error = c.error or "error"
                    if c.usage is not None:
                        rec.output_tokens, rec.prompt_len = c.usage.completion_tokens, c.usage.prompt_tokens
                        rec.cached_tokens = c.usage.cached_tokens
        except Exception as exc:  # noqa: BLE001 - a refused request is a failed request, counted
            rec.error = f"{type(exc).__name__}: {exc}"
        rec.end = time.perf_counter()
        return rec

    async def reset_prefix_cache(self) -> int:
        """The deployment forgets its cached prefixes (free blocks); returns how many blocks."""
        return (await self.client.reset_prefix_cache()).get("prefix_blocks_forgotten", 0)

    async def close(self) -> None:
        if self._own:
            self.client.close()


class OpenAITarget:
    """The gateway's OpenAI completions endpoint, streamed (SSE with include_usage); any other OpenAI-compatible
    server too. `reuse_connections=False` opens a connection per request: llama-cpp-python's server drops a
    request sent on a kept-alive connection after a long stream. `extra_body` adds a server's own fields to
    every request (e.g. llama.cpp's `repeat_penalty`)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 connect_timeout_s: float = 10.0, *, reuse_connections: bool = True,
                 extra_body: dict[str, Any] | None = None) -> None:
        import httpx

        self.label = f"openai {base_url}"
        self.base = base_url.rstrip("/").removesuffix("/v1")
        self.extra_body = dict(extra_body or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64 if reuse_connections else 0)
        self.http = httpx.AsyncClient(base_url=self.base, headers=headers, timeout=httpx.Timeout(None, connect=connect_timeout_s),
                                      limits=limits)
        self.model = model

    async def open(self) -> dict[str, Any]:
        import httpx

        try:
            r = await self.http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise UnavailableError(f"the gateway at {self.base} did not answer: {exc!r}") from None
        if r.status_code != 200:
            raise UnavailableError(f"GET {self.base}/v1/models answered {r.status_code}: {r.text[:200]}")
        models = [m["id"] for m in r.json().get("data", [])]
        if self.model is None:
            self.model = models[0] if models else None
        return {"model": self.model}

    async def send(self, req: BenchRequest, params: dict[str, Any]) -> RequestRecord:
        body = {"model": self.model, "prompt": req.prompt, "max_tokens": params["max_new_tokens"],
                "temperature": params["temperature"], "ignore_eos": params["ignore_eos"], "stream": True,
                "stream_options": {"include_usage": True}}
        if "min_new_tokens" in params:
            body["min_tokens"] = params["min_new_tokens"]
        body.update(self.extra_body)
        rec = RequestRecord(req.prompt_len, req.output_len, time.perf_counter(), chunk_tokens=None)
        finish: list[str] = []
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                else:
                    async for line in r.aiter_lines():
                        self._event(rec, line, finish)
        except Exception as exc:  # noqa: BLE001 - counted as failed
            rec.error = f"{type(exc).__name__}: {exc}"
        if rec.ok and not rec.output_tokens:
            # A server that streams no usage (llama-cpp-python): a "length" finish means exactly max_tokens
            # tokens; any other end counts the chunks, one token each as such servers stream them.
            rec.output_tokens = body["max_tokens"] if finish[-1:] == ["length"] else len(rec.chunk_times)
        rec.end = time.perf_counter()
        return rec

    @staticmethod
    def _event(rec: RequestRecord, line: str, finish: list[str] | None = None) -> None:
        """One SSE line of a completion stream into the record; a finish reason is appended to `finish`."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        ev = json.loads(line[6:])
        if "error" in ev:
            rec.error = ev["error"].get("message", "error")
            return
        if ev.get("choices") and ev["choices"][0].get("text"):
            rec.chunk_times.append(time.perf_counter())
        if finish is not None and ev.get("choices") and ev["choices"][0].get("finish_reason"):
            finish.append(ev["choices"][0]["finish_reason"])
        if ev.get("usage"):
            rec.output_tokens = ev["usage"]["completion_tokens"]
            rec.prompt_len = ev["usage"]["prompt_tokens"]
            rec.cached_tokens = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")

    async def reset_prefix_cache(self) -> int:
        import httpx

        try:
            r = await self.http.post("/reset_prefix_cache")
            if r.status_code != 200:
                raise UnavailableError(f"POST {self.base}/reset_prefix_cache answered {r.status_code}: {r.text[:200]}")
            return int(r.json().get("prefix_blocks_forgotten", 0))
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise UnavailableError(f"POST {self.base}/reset_prefix_cache failed: {exc!r}") from None

    async def close(self) -> None:
        await self.http.aclose()


class WebSocketTarget:
    """The gateway's WebSocket: requests multiplexed over a few connections, `per_connection` live on each."""

    def __init__(self, url: str, api_key: str | None = None, per_connection: int = 64,
                 connect_timeout_s: float = 10.0) -> None:
        self.label = f"websocket {url}"
        self.url = url + (("&" if "?" in url else "?") + f"api_key={api_key}" if api_key else "")
        self.api_key = api_key
        self.per_connection, self.timeout_s = per_connection, connect_timeout_s
        self._conns: list[_WsConn] = []
        self._lock = asyncio.Lock()

    async def open(self) -> dict[str, Any]:
        try:
            conn = await _WsConn.connect(self.url, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure to connect means the target is unreachable
            raise UnavailableError(f"the WebSocket {self.label[10:]} did not open: {exc!r}") from None
        self._conns.append(conn)
        return {"model": await asyncio.get_running_loop().run_in_executor(None, self._model_name)}

    def _http(self, path: str, method: str = "GET") -> Any:
        """A JSON request to the same gateway over HTTP (blocking: run it in an executor)."""
        import urllib.request

        base = self.url.split("/v1/ws", 1)[0].replace("ws", "http", 1)
        req = urllib.request.Request(base + path, method=method, headers={"Authorization": f"Bearer {self.api_key}"}
                                     if self.api_key else {})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read())

    def _model_name(self) -> str | None:
        """The served model's name, from the same gateway's /v1/models (None if it does not say)."""
        try:
            return (self._http("/v1/models").get("data") or [{}])[0].get("id")
        except (OSError, ValueError):
            return None

    async def reset_prefix_cache(self) -> int:
        try:
            r = await asyncio.get_running_loop().run_in_executor(None, self._http, "/reset_prefix_cache", "POST")
        except (OSError, ValueError) as exc:
            raise UnavailableError(f"POST /reset_prefix_cache on {self.label[10:]} failed: {exc}") from None
        return r.get("prefix_blocks_forgotten", 0)

    async def _conn(self) -> _WsConn:
        async with self._lock:
            for c in self._conns:
                if c.alive and len(c.waiting) < self.per_connection:
                    return c
            c = await _WsConn.connect(self.url, self.timeout_s)
            self._conns.append(c)
            return c

    async def send(self, req: BenchRequest, params: dict[str, Any]) -> RequestRecord:
        rec = RequestRecord(req.prompt_len, req.output_len, time.perf_counter())
        try:
            conn = await self._conn()
            async for frame in conn.request(req.prompt, params):
                if frame["type"] == "token" and frame.get("token_ids"):
                    rec.chunk_times.append(time.perf_counter())
                    rec.chunk_tokens.append(len(frame["token_ids"]))
                elif frame["type"] == "done":
                    usage = frame.get("usage") or {}
                    rec.output_tokens = usage.get("completion_tokens") or 0
                    rec.prompt_len = usage.get("prompt_tokens") or rec.prompt_len
                    rec.cached_tokens = usage.get("cached_tokens")
                    if frame.get("finish_reason") == "error":
                        rec.error = frame.get("error") or "error"
                elif frame["type"] == "error":
                    rec.error = f"{frame.get('code')}: {frame.get('message')}"
        except Exception as exc:  # noqa: BLE001 - counted as failed
            rec.error = f"{type(exc).__name__}: {exc}"
        rec.end = time.perf_counter()
        return rec

    async def close(self) -> None:
        for c in self._conns:
            await c.close()


class _WsConn:
    """One connection: a reader task routes frames to each request's queue by id."""

    _ids = itertools.count()

    def __init__(self, ws: Any) -> None:
        self.ws, self.waiting, self.alive = ws, {}, True
        self.reader = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, url: str, timeout_s: float) -> _WsConn:
        import websockets

        return cls(await websockets.connect(url, max_size=None, open_timeout=timeout_s, ping_interval=None))

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                frame = json.loads(raw)
                q = self.waiting.get(frame.get("id"))
                if q is not None:
                    q.put_nowait(frame)
        except Exception:  # noqa: BLE001 - the connection is gone; every waiting request learns it below
            pass
        self.alive = False
        for q in self.waiting.values():
            q.put_nowait({"type": "error", "code": "connection_closed", "message": "the WebSocket closed"})

    async def request(self, prompt: Any, params: dict[str, Any]):
        req_id = f"b{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self.waiting[req_id] = q
        try:
            await self.ws.send(json.dumps({"type": "generate", "id": req_id, "prompt": prompt, **params}))
            while True:
                frame = await q.get()
                yield frame
                if frame["type"] in ("done", "error"):
                    return
        finally:
            self.waiting.pop(req_id, None)

    async def close(self) -> None:
        await self.ws.close()
        self.reader.cancel()


def make_target(target: str, *, api_key: str | None = None, curve_dir: str | None = None,
                model_name: str | None = None, connect_timeout_s: float = 10.0) -> Any:
    """tcp://… → the router; http(s)://… → OpenAI completions; ws(s)://… → the WebSocket."""
    if target.startswith(("tcp://", "ipc://")):
        return RouterTarget(target, curve_dir, connect_timeout_s=connect_timeout_s)
    if target.startswith(("http://", "https://")):
        return OpenAITarget(target, api_key, model_name, connect_timeout_s)
    if target.startswith(("ws://", "wss://")):
        url = target if "/v1/ws" in target else target.rstrip("/") + "/v1/ws"
        return WebSocketTarget(url, api_key, connect_timeout_s=connect_timeout_s)
    raise InvalidParameterError("target", f"must start with tcp://, http(s):// or ws(s)://, got {target!r}")
