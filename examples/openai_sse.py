"""Stream /v1/chat/completions as server-sent events with `httpx`, without the `openai` package.

Start a deployment with its gateway in another terminal (HTTP on http://127.0.0.1:8000 by default):

    .venv/bin/mii-async serve

then run (httpx comes with the `test` and `bench` extras, or `pip install httpx`):

    .venv/bin/python examples/openai_sse.py --url http://127.0.0.1:8000 "What is the capital of France?"

With `"stream": true` the answer comes as `text/event-stream`: one `data: {json}` event per streamed step,
each a `chat.completion.chunk` whose `choices[0].delta` holds the new text (the first one has the role, the
last one the finish_reason); with `stream_options.include_usage` a last chunk with empty `choices` carries
the usage; then `data: [DONE]`. An error after the stream began comes as `data: {"error": {...}}`. A refused
request (a bad parameter, an unknown model, overload) is answered before any event, with an HTTP error
status and OpenAI's JSON error body. Closing the connection early aborts the request on the server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

try:
    import httpx
except ImportError:                            # not a dependency of mii_async itself
    raise SystemExit("this example needs httpx: pip install httpx (or the `test` extra)") from None


class APIError(Exception):
    """The gateway refused the request, or failed it mid-stream; the message is the server's."""


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON payload of each `data:` event, until `data: [DONE]`. Events are separated by a blank line;
    this server sends one `data:` line per event, and no `event:`/`id:` fields, so a line reader suffices."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue                          # blank separators, and `:` comments (keepalives) if any
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def stream_chat(url: str, api_key: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """Prints the answer's deltas as they arrive; returns the finish_reason and usage."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    finish_reason, usage = None, None
    # No read timeout: on a busy server the next token may be a while; connecting still times out.
    timeout = httpx.Timeout(10.0, read=None)
    # Leaving the `async with` closes the connection: before [DONE], that aborts the request on the server.
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:       # refused before any event: OpenAI's error body
            await response.aread()
            try:
                err = response.json()["error"]
            except (ValueError, KeyError, TypeError):
                raise APIError(f"HTTP {response.status_code}: {response.text}") from None
            param = f" (parameter {err['param']})" if err.get("param") else ""
            raise APIError(f"HTTP {response.status_code}: {err.get('message')}{param}")
        async for chunk in sse_events(response):
            if "error" in chunk:              # failed after the stream began
                raise APIError(chunk["error"].get("message", str(chunk["error"])))
            if chunk.get("usage"):            # the include_usage chunk: choices is empty
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                print(choice["delta"].get("content", ""), end="", flush=True)
                finish_reason = choice["finish_reason"] or finish_reason
    print()
    return {"finish_reason": finish_reason, "usage": usage}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("question", nargs="?", default="What is the capital of France?")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--api-key", default=os.environ.get("MII_ASYNC_API_KEY"),
                   help="when the gateway requires one (default: $MII_ASYNC_API_KEY)")
    p.add_argument("--model", default=None, help="the served model's name (default: whatever it serves)")
    p.add_argument("--system", default=None, help="a system message before the question")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    a = p.parse_args(argv)
    messages = ([{"role": "system", "content": a.system}] if a.system else []) + \
        [{"role": "user", "content": a.question}]
    body: dict[str, Any] = {"messages": messages, "max_tokens": a.max_tokens, "temperature": a.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if a.model:
        body["model"] = a.model
    try:
        result = asyncio.run(stream_chat(a.url.rstrip("/"), a.api_key, body))
    except APIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:       # not reachable, or the connection broke
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    u = result["usage"] or {}
    print(f"[finish_reason={result['finish_reason']} prompt_tokens={u.get('prompt_tokens')} "
          f"completion_tokens={u.get('completion_tokens')}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
