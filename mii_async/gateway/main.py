"""The gateway process: `python -m mii_async.gateway --router ADDR [--config JSON] [--status-fd N]`.

`mii-async serve` and `mii_async.serve(enable_http=True)` start it once the router is ready, as a child with a
lifeline; `mii-async gateway --router ADDR` runs one by hand (any number may front one router). It binds its
socket itself (so `http_port=0` works), then runs uvicorn (`ws="websockets"`) on uvloop, and writes one JSON line
({"url", "pid"}) to the status pipe once it accepts connections. The API key comes from $MII_ASYNC_API_KEY,
not the command line, so that `ps` does not show it. SIGTERM/SIGINT: uvicorn's graceful shutdown (open
streams get `drain_s`) for a gateway run by hand; one started with a lifeline leaves them to its parent. When
the lifeline ends (the parent, which runs the router or started it, is gone) there is nothing to drain for:
every open stream fails at once (an SSE error event then [DONE]; a WebSocket error frame), and the gateway
exits within 2 × EXIT_FLUSH_S.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from typing import Callable

from ..config import HttpConfig

log = logging.getLogger("mii_async.gateway")
API_KEY_ENV = "MII_ASYNC_API_KEY"
EXIT_FLUSH_S = 1.0      # its parent gone, how long the failed streams get to send their last events, and then
                        # uvicorn's shutdown to close the connections, before the gateway exits regardless
PARENT_GONE = "the deployment stopped: the process that runs its router (or started it) is gone"


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        from ..errors import InvalidParameterError

        raise InvalidParameterError("http_port", f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(False)
    return sock


async def run_gateway(router: str, http: HttpConfig, on_ready: Callable[[dict], None], *,
                      curve_dir: str | None = None, tokenizer: str | None = None, drain_s: float = 30.0,
                      lifeline_fd: int | None = None) -> int:
    import warnings

    import uvicorn

    # uvicorn warns that ws="websockets" (the websockets library's legacy server) will later mean its
    # sans-I/O implementation; we ask for it by name on purpose, so the warning would only be noise.
    warnings.filterwarnings("ignore", message="The `websockets` implementation is deprecated")

    from ..async_client import AsyncClient
    from ..lifecycle import watch_lifeline
    from .app import create_app
    from .state import GatewayState

    from ..errors import MIIAsyncError, error_code

    try:
        sock = bind(http.http_host, http.http_port)
    except MIIAsyncError as exc:
        on_ready({"error": str(exc), "code": error_code(exc), "param": getattr(exc, "param", None)})
        return 1
    host, port = sock.getsockname()[:2]
    state = GatewayState(AsyncClient(router, curve_dir=curve_dir), http, tokenizer)
    # httptools (uvloop's authors' C parser) rather than h11: a streamed token is an HTTP chunk, and h11's
    # pure-Python writer was the gateway's largest cost per SSE token. uvicorn's httptools protocol bounds
    # neither a request head's time or size nor open connections: guarded_protocol() adds them.
    from .connection_limits import KEEP_ALIVE_S, guarded_protocol

    config = uvicorn.Config(create_app(state), http=guarded_protocol(http, state.metrics), ws="websockets",
                            loop="uvloop", lifespan="on", timeout_keep_alive=KEEP_ALIVE_S,
                            ws_max_size=http.ws_max_message_bytes, ws_ping_interval=http.ws_ping_s,
                            ws_ping_timeout=http.ws_ping_s, timeout_graceful_shutdown=max(1, int(drain_s)),
                            log_level="warning", access_log=False, server_header=False)
    server = (_supervised_server_class() if lifeline_fd is not None else uvicorn.Server)(config)
    loop = asyncio.get_running_loop()
    if lifeline_fd is not None:
        def parent_gone() -> None:
            state.client.mark_unavailable(PARENT_GONE)     # open streams end with their error now; new ones 503
            server.exit_after(EXIT_FLUSH_S)

        watch_lifeline(lifeline_fd, lambda: loop.call_soon_threadsafe(parent_gone))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        on_ready({"error": "the gateway could not start (see its log)", "code": "unavailable"})
        return 1
    shown = f"[{host}]" if ":" in host else host
    on_ready({"url": f"http://{shown}:{port}", "pid": os.getpid()})
    await task
    return 0


def _supervised_server_class():
    import uvicorn

    class Supervised(uvicorn.Server):
        """A gateway that `mii-async serve` started leaves SIGINT and SIGTERM to it: a terminal's Ctrl-C (or
        systemd's stop) signals the whole group, and this gateway must go on serving while the router drains
        (new requests then get 503 "draining"); `serve` stops it afterwards through the lifeline."""

        @contextlib.contextmanager
        def capture_signals(self):
            def ignore(signum: int, _: object) -> None:
                log.info("%s: the deployment drives this gateway's shutdown", signal.Signals(signum).name)

            before = {sig: signal.signal(sig, ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

        def exit_after(self, flush_s: float) -> None:
            """Exits without a drain (its parent is gone, and the router with it or after it): the open
            connections get `flush_s` to send what their failed streams wrote, then the shutdown closes them,
            and `flush_s` later stops waiting for any still open (timeout_graceful_shutdown would wait for a
            stream for drain_s). Call it on the server's loop."""
            loop = asyncio.get_running_loop()

            def stop() -> None:
                self.should_exit = True
                loop.call_later(flush_s, setattr, self, "force_exit", True)

            loop.call_later(flush_s, stop)

    return Supervised


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mii_async.gateway")
    p.add_argument("--router", required=True, help="the router's client address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--config", default="{}", help="HttpConfig fields as JSON (api_key from $%s)" % API_KEY_ENV)
    p.add_argument("--curve-dir", default=None)
    p.add_argument("--tokenizer", default=None, help="the model directory, when the router's is not local")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--status-fd", type=int, default=None)
    p.add_argument("--lifeline-fd", type=int, default=None)
    p.add_argument("--log-level", default=os.environ.get("MII_ASYNC_LOG_LEVEL", "INFO"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    from ..lifecycle import run_uvloop, set_process_name

    set_process_name("mii-gateway")
    cfg = json.loads(a.config)
    if os.environ.get(API_KEY_ENV):
        cfg["api_key"] = os.environ[API_KEY_ENV]
    http = HttpConfig(**cfg)

    def on_ready(status: dict) -> None:
        if a.status_fd is not None:
            os.write(a.status_fd, (json.dumps(status) + "\n").encode())
            os.close(a.status_fd)

    try:
        return run_uvloop(run_gateway(a.router, http, on_ready, curve_dir=a.curve_dir, tokenizer=a.tokenizer,
                                      drain_s=a.drain_timeout, lifeline_fd=a.lifeline_fd))
    except KeyboardInterrupt:       # uvicorn re-raises the SIGINT it shut down on (Ctrl-C hits the whole group)
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
