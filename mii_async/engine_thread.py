"""EngineThread: the local pipeline's engine loop, on a thread of its own.

The thread builds and owns the Engine, so that every torch op of the pipeline runs on it (see `_run`); other
threads talk to it only through a command queue, and it answers each request through that request's sink (a
callable, called on the engine thread, that must not block). torch releases the GIL inside its ops, so the
caller's event loop keeps running while a step computes.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from .config import EngineConfig
from .errors import EngineClosedError
from .params import SamplingParams
from .text.request_state import Ended

log = logging.getLogger("mii_async.engine")
Sink = Callable[[Any], None]


class EngineThread:
    def __init__(self, config: EngineConfig) -> None:
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}    # touched only by the engine thread
        self._closed = False
        loaded: Future[Any] = Future()
        self._thread = threading.Thread(target=self._run, args=(config, loaded), name="mii_async-engine",
                                        daemon=True)
        self._thread.start()
        try:
            loaded.result()                  # a load error is raised here, in the caller
        except BaseException:
            self.close()                     # Ctrl-C during the load: the thread exits once it has loaded
            raise

    # -- any thread ----------------------------------------------------------------------------------
    def submit(self, req_id: int, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Queues a request the caller has checked (`engine.check_request`); a request the engine still refuses
        is answered through its sink with Ended("error")."""
        if self._closed:
            raise EngineClosedError("the pipeline is closed")
        self._cmds.put(("add", req_id, prompt_ids, params, sink))

    def abort(self, req_id: int) -> None:
        if not self._closed:
            self._cmds.put(("abort", req_id))

    def stats(self) -> dict[str, int]:
        fut: Future[dict[str, int]] = Future()
        self._cmds.put(("stats", fut))
        return fut.result(timeout=60)

    def reset_prefix_cache(self) -> int:
        """The engine forgets the prefixes of the blocks no request holds; returns how many."""
        fut: Future[int] = Future()
        self._cmds.put(("reset_prefix_cache", fut))
        return fut.result(timeout=60)

    def close(self) -> None:
        """Ends every live request with finish_reason "abort" and stops the thread. Idempotent. Called while
        the engine still loads (the caller was interrupted), it returns at once; the thread exits after."""
        if self._closed:
            return
        self._closed = True
        self._cmds.put(("stop",))
        if hasattr(self, "engine"):
            self._thread.join()

    # -- engine thread -------------------------------------------------------------------------------
    def _run(self, config: EngineConfig, loaded: Future) -> None:
        # The engine is built on this thread, which then runs every torch op of the pipeline: with the OpenMP
        # build of torch, once a second thread has run a parallel region, each thread's team of workers
        # outnumbers the cores and its regions start from sleep (~6× slower small ops on 2 cores).
        try:
            from mii_async.workers.engine import Engine   # lazily: `import mii_async` stays free of torch

            self.engine = eng = Engine(config)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            loaded.set_exception(exc)
            return
        loaded.set_result(eng)
        while True:
            cmd = self._cmds.get() if not eng.has_work() else self._next_nowait()
            while cmd is not None:
                if cmd[0] == "stop":
                    for req_id in list(self._sinks):
                        self._end(req_id, Ended("abort", "the pipeline was closed"))
                    eng.close()
                    return
                self._handle(cmd)
                cmd = self._next_nowait()
            if eng.has_work():
                self._step()

    def _next_nowait(self) -> tuple | None:
        try:
            return self._cmds.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, req_id, prompt_ids, params, sink = cmd
            self._sinks[req_id] = sink
            try:
                self.engine.add_request(req_id, prompt_ids, params)
            except Exception as exc:  # noqa: BLE001 - one bad request is answered, never stops the loop
                self._end(req_id, Ended("error", str(exc)))
        elif kind == "abort":
            if cmd[1] in self._sinks:
                self._end(cmd[1], Ended("abort"))
        elif kind == "stats":
            cmd[1].set_result(self.engine.stats())
        elif kind == "reset_prefix_cache":
            cmd[1].set_result(self.engine.reset_prefix_cache())

    def _step(self) -> None:
        try:
            # The step in flight's tokens are delivered as soon as they are read (during this launch, maybe).
            self._deliver_all(self.engine.step(emit=self._deliver_all))
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
            log.exception("engine step failed")
            for req_id in list(self._sinks):
                self._end(req_id, Ended("error", f"engine step failed: {exc}"))
            for req_id in list(self.engine.seqs):    # any with no consumer left: its blocks go back too
                self.engine.abort(req_id)
        finally:
            for req_id, why, param in self.engine.take_failed():   # e.g. a guide the vocabulary cannot follow
                self._end(req_id, Ended("error", why, param))

    def _deliver_all(self, outputs: list) -> None:
        for out in outputs:
            sink = self._sinks.get(out.req_id)
            if sink is None:
                continue
            if not self._deliver(out.req_id, sink, out):
                continue
            if out.finish_reason is not None:
                del self._sinks[out.req_id]

    def _deliver(self, req_id: int, sink: Sink, ev: Any) -> bool:
        try:
            sink(ev)
            return True
        except Exception:  # noqa: BLE001 - the consumer is gone (closed loop): drop its request
            self.engine.abort(req_id)
            self._sinks.pop(req_id, None)
            return False

    def _end(self, req_id: int, ev: Ended) -> None:
        self.engine.abort(req_id)
        sink = self._sinks.pop(req_id, None)
        if sink is not None:
            self._deliver(req_id, sink, ev)
