"""A terminal chat over the gateway's WebSocket, /v1/ws, with the `websockets` package.

Start a deployment with its gateway in another terminal (HTTP on http://127.0.0.1:8000 by default):

    .venv/bin/mii-async serve

then chat (an empty line or Ctrl-D quits, /reset forgets the conversation, Ctrl-C stops the answer being
written; once the conversation outgrows the model's context, its oldest turns are forgotten):

    .venv/bin/python examples/websocket_chat.py --url http://127.0.0.1:8000

or ask one question and exit:

    .venv/bin/python examples/websocket_chat.py --once "What is the capital of France?"

The whole conversation is sent with every turn as chat `messages` (the server keeps no session; its prefix
cache makes the repeated history cheap). The frames are those of docs/websocket.md:

    → {"type": "generate", "id": ID, "messages": [...], "max_new_tokens": N, ...sampling parameters}
    ← {"type": "token", "id": ID, "text": "..."}        one per streamed step
    ← {"type": "done", "id": ID, "finish_reason": "stop" | "length" | "abort", "usage": {...}}
    → {"type": "cancel", "id": ID}                      answered by the request's done frame, "abort"
    ← {"type": "error", "id": ID, "code": "...", "message": "...", "param": ...}
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus


class Reply(NamedTuple):
    text: str
    finish_reason: str           # "stop" | "length" | "abort"
    usage: dict[str, Any]


class ChatError(Exception):
    """The server refused or failed a request (an error frame); the connection is still usable."""

    def __init__(self, frame: dict[str, Any]) -> None:
        param = f" (parameter {frame['param']})" if frame.get("param") else ""
        super().__init__(f"{frame['code']}: {frame['message']}{param}")
        self.code, self.param = frame.get("code"), frame.get("param")

    def outgrew_context(self) -> bool:
        """The prompt and the answer cannot fit the context (or the KV pool) together."""
        return self.code == "request_too_long" and self.param in ("max_new_tokens", "prompt", "messages")


def ws_url(url: str) -> str:
    """http://host:port (the gateway's base URL) → ws://host:port/v1/ws; a ws:// URL is taken as it is."""
    if url.startswith(("ws://", "wss://")):
        return url
    if url.startswith(("http://", "https://")):
        return "ws" + url[len("http"):].rstrip("/") + "/v1/ws"
    raise SystemExit(f"--url: expected http(s)://HOST:PORT or ws(s)://HOST:PORT/v1/ws, got {url!r}")


@contextmanager
def on_ctrl_c(callback: Callable[[], None]) -> Iterator[None]:
    """While inside, Ctrl-C calls `callback` on the event loop instead of stopping the program."""
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGINT)
    try:
        loop.add_signal_handler(signal.SIGINT, callback)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):   # Windows, or not the main thread
        installed = False
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
            signal.signal(signal.SIGINT, previous)            # asyncio.run's own handler, which stops main()


async def ask(ws: ClientConnection, req_id: str, messages: list[dict[str, str]], params: dict[str, Any]) -> Reply:
    """Sends one chat request and prints its tokens as they come. Ctrl-C meanwhile sends a cancel frame: the
    server aborts the request (freeing its KV blocks) and answers with a done frame whose reason is "abort"."""
    await ws.send(json.dumps({"type": "generate", "id": req_id, "messages": messages, **params}))
    pending: set[asyncio.Task] = set()

    def cancel() -> None:
        task = asyncio.ensure_future(ws.send(json.dumps({"type": "cancel", "id": req_id})))
        pending.add(task)                                     # a reference, so it is not collected mid-send
        task.add_done_callback(pending.discard)

    parts: list[str] = []
    with on_ctrl_c(cancel):
        while True:
            frame = json.loads(await ws.recv())
            if frame.get("id") != req_id:                     # pongs, or another request's frames
                continue
            if frame["type"] == "token":
                print(frame["text"], end="", flush=True)
                parts.append(frame["text"])
            elif frame["type"] == "done":
                print(flush=True)
                return Reply("".join(parts), frame["finish_reason"], frame.get("usage") or {})
            elif frame["type"] == "error":
                print(flush=True)
                raise ChatError(frame)


async def ask_fitting(ws: ClientConnection, req_id: str, history: list[dict[str, str]],
                      params: dict[str, Any]) -> Reply:
    """ask(), forgetting the oldest turns (in place) while the conversation is too long for the context, as
    `mii-async chat` does; a question that does not fit even alone is the server's error."""
    while True:
        try:
            return await ask(ws, req_id, history, params)     # ids may be reused once done (an error is done)
        except ChatError as exc:
            if not exc.outgrew_context() or len(history) < 3:
                raise
            del history[:2]
            print("[the oldest turn was forgotten: the conversation outgrew the context]\nbot> ", end="", flush=True)


def report(reply: Reply) -> None:
    u = reply.usage
    print(f"[finish_reason={reply.finish_reason} prompt_tokens={u.get('prompt_tokens')} "
          f"completion_tokens={u.get('completion_tokens')}]", flush=True)


async def read_line(prompt: str) -> str | None:
    """input() on a daemon thread, so that the event loop keeps answering the server's keepalive pings while
    the user thinks (a blocked loop would be disconnected after ~40 s). None at end of input."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[str | None] = loop.create_future()

    def resolve(line: str | None) -> None:
        if not fut.done():
            fut.set_result(line)

    def target() -> None:
        try:
            line: str | None = input(prompt)
        except EOFError:
            line = None
        with contextlib.suppress(RuntimeError):               # the loop is already closed: we are exiting
            loop.call_soon_threadsafe(resolve, line)

    threading.Thread(target=target, name="stdin", daemon=True).start()
    return await fut


async def chat(url: str, api_key: str | None, params: dict[str, Any], once: str | None) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with connect(ws_url(url), additional_headers=headers) as ws:
        hello = json.loads(await ws.recv())                   # {"type": "hello", "model": ..., ...}
        if once is not None:
            try:
                report(await ask(ws, "once", [{"role": "user", "content": once}], params))
            except ChatError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            return 0

        print(f"connected to {hello.get('model')}: type a message; an empty line or Ctrl-D quits, "
              "/reset forgets the conversation, Ctrl-C stops an answer", flush=True)
        history: list[dict[str, str]] = []
        turn = 0
        while True:
            line = await read_line("you> ")
            if line is None or not line.strip():
                return 0
            if line.strip() == "/reset":
                history.clear()
                print("[history cleared]", flush=True)
                continue
            turn += 1
            history.append({"role": "user", "content": line.strip()})
            print("bot> ", end="", flush=True)
            try:
                reply = await ask_fitting(ws, f"turn-{turn}", history, params)
            except ChatError as exc:
                history.pop()                                 # the question was not answered: forget it
                print(f"error: {exc}", file=sys.stderr, flush=True)
                continue
            if reply.text:                                    # a stopped answer stays, as far as it got
                history.append({"role": "assistant", "content": reply.text})
            else:
                history.pop()
            report(reply)
            print(f"[{len(history)} messages in the conversation]", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the gateway's base URL (or its ws://HOST:PORT/v1/ws address)")
    p.add_argument("--api-key", default=os.environ.get("MII_ASYNC_API_KEY"),
                   help="when the gateway requires one (default: $MII_ASYNC_API_KEY)")
    p.add_argument("--once", metavar="QUESTION", default=None, help="answer this one question and exit")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    a = p.parse_args(argv)
    params = {"max_new_tokens": a.max_new_tokens, "temperature": a.temperature}
    try:
        return asyncio.run(chat(a.url, a.api_key, params, a.once))
    except KeyboardInterrupt:                                 # Ctrl-C at the prompt
        print()
        return 130
    except InvalidStatus as exc:                              # the handshake was refused: 401, 403, …
        print(f"error: the gateway refused the connection: HTTP {exc.response.status_code}", file=sys.stderr)
        return 1
    except (OSError, ConnectionClosed) as exc:                # not reachable, or it went away
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
