"""Router process entry: run a Router until it is shut down.

`python -m mii_async.router --config JSON [--status-fd N] [--lifeline-fd M]` is how `mii_async.serve()` starts
it: once every replica is ready, one JSON line goes to the status pipe ({"address", "worker_address", …}, or
{"error", "code"} when the deployment could not start). `mii-async serve` calls `run()` in its own process.
SIGTERM and SIGINT drain for `drain_timeout_s`; a second signal stops at once. The end of the lifeline (the
parent is gone) stops at once. Exit status: 0 after a shutdown (or a stop during startup), 1 when the
deployment could not start, 2 when an address could not be bound.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Callable

from ..config import EngineConfig, ServeConfig
from ..lifecycle import run_uvloop, set_process_name, watch_lifeline

log = logging.getLogger("mii_async.router")


async def run_router(serve: ServeConfig, engine: EngineConfig, on_ready: Callable[[dict], None],
                     lifeline_fd: int | None = None, on_stopper: Callable[[Callable[[], None]], None] | None = None
                     ) -> int:
    """`on_stopper` receives a function that any thread may call to stop the deployment as a first signal
    would: it starts a drain, and leaves one in progress alone (a second signal would cut it short)."""
    from ..errors import MIIAsyncError, error_code
    from .server import Router, StartupError

    loop = asyncio.get_running_loop()
    try:
        router = Router(serve, engine)
    except MIIAsyncError as exc:                    # e.g. a port in use: named, before any model loads
        on_ready({"error": str(exc), "code": error_code(exc), "param": getattr(exc, "param", None)})
        return 2

    def on_signal() -> None:
        if router.state == "draining":
            router.stop_draining()            # a second signal: abort what is left now
        router.request_shutdown(serve.drain_timeout_s)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    if on_stopper is not None:
        on_stopper(lambda: loop.call_soon_threadsafe(router.request_shutdown, serve.drain_timeout_s))
    if lifeline_fd is not None:
        def parent_gone() -> None:
            router.stop_draining()
            router.request_shutdown(0.0)

        watch_lifeline(lifeline_fd, lambda: loop.call_soon_threadsafe(parent_gone))
    try:
        await router.start()
        await router.wait_ready()
    except StartupError as exc:
        on_ready({"error": str(exc), "code": exc.code})
        await router.shutdown(0.0)
        return 1
    except Exception as exc:  # noqa: BLE001 - report any startup failure (a missing model, a bad port)
        if router.state != "starting":              # a signal stopped it midway: not a failure
            on_ready({"error": "the router was stopped while starting", "code": "unavailable", "stopped": True})
            await router.request_shutdown(0.0)
            return 0
        if isinstance(exc, MIIAsyncError):          # ours, with a message that says it all
            log.error("the router could not start: %s", exc)
        else:
            log.exception("the router could not start")
        on_ready({"error": f"{exc}", "code": error_code(exc), "param": getattr(exc, "param", None)})
        await router.shutdown(0.0)
        return 1
    if router.state != "ready":                     # a signal or the parent's end came during startup
        on_ready({"error": "the router was stopped while starting", "code": "unavailable", "stopped": True})
        await router.serve_forever()
        return 0
    on_ready({"address": router.address, "worker_address": router.worker_address, "pid": os.getpid(),
              "curve_dir": router.keys_dir,
              "replicas": len(router.replicas.ready()), "model": str(router.model_path)})
    await router.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mii_async.router")
    p.add_argument("--config", required=True, help='JSON: {"serve": {...}, "engine": {...}}')
    p.add_argument("--status-fd", type=int, default=None)
    p.add_argument("--lifeline-fd", type=int, default=None)
    p.add_argument("--log-level", default=os.environ.get("MII_ASYNC_LOG_LEVEL", "INFO"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    set_process_name("mii-router")
    cfg = json.loads(a.config)
    serve, engine = ServeConfig(**cfg["serve"]), EngineConfig.from_dict(cfg["engine"])

    def on_ready(status: dict) -> None:
        if a.status_fd is not None:
            os.write(a.status_fd, (json.dumps(status) + "\n").encode())
            os.close(a.status_fd)

    return run_uvloop(run_router(serve, engine, on_ready, a.lifeline_fd))


if __name__ == "__main__":
    raise SystemExit(main())
