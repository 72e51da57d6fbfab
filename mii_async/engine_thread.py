"""EngineThread: the local pipeline's driver of the engine loop (`workers/engine_loop.py`), on a thread of its own.

The thread builds and owns the Engine and runs its EngineLoop, so that every torch op of the pipeline runs on it
(see `_run`); other threads talk to it only through a queue of the loop's commands, and it answers each request
through that request's sink (a callable, called on the engine thread, that must not block). torch releases the
GIL inside its ops, so the caller's event loop keeps running while a step computes. `mii_async.workers` is
imported when a pipeline starts, never with `mii_async`, which stays free of torch.
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
Sink = Callable[[Any], None]      # takes an EngineOutput (a token) or an Ended


class EngineThread:
    def __init__(self, config: EngineConfig) -> None:
        from mii_async.workers import engine_loop    # lazily: `import mii_async` stays free of torch

        self._loop_mod = engine_loop
        # (a command, and for an AddRequest its sink): the sink is registered on the engine thread, before the
        # loop can answer the request
        self._inbox: queue.SimpleQueue[tuple[Any, Sink | None]] = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}    # the live requests' sinks; touched only by the engine thread
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
        self._inbox.put((self._loop_mod.AddRequest(req_id, prompt_ids, params), sink))

    def abort(self, req_id: int) -> None:
        """Ends a live request: its sink gets Ended("abort"), and its KV blocks are freed within a step."""
        if not self._closed:
            self._inbox.put((self._loop_mod.Abort(req_id), None))

    def stats(self) -> dict[str, int]:
        fut: Future[dict[str, int]] = Future()
        self._inbox.put((self._loop_mod.QueryStats(fut), None))
        return fut.result(timeout=60)

    def reset_prefix_cache(self) -> int:
        """The engine forgets the prefixes of the blocks no request holds; returns how many."""
        fut: Future[int] = Future()
        self._inbox.put((self._loop_mod.QueryStats(fut, reset_prefix_cache=True), None))
        return fut.result(timeout=60)

    def close(self) -> None:
        """Ends every live request with finish_reason "abort" and stops the thread. Idempotent. Called while
        the engine still loads (the caller was interrupted), it returns at once; the thread exits after."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put((self._loop_mod.Stop("the pipeline was closed"), None))
        if hasattr(self, "engine"):
            self._thread.join()

    # -- engine thread -------------------------------------------------------------------------------
    def _run(self, config: EngineConfig, loaded: Future) -> None:
        # The engine is built on this thread, which then runs every torch op of the pipeline: with the OpenMP
        # build of torch, once a second thread has run a parallel region, each thread's team of workers
        # outnumbers the cores and its regions start from sleep (~6× slower small ops on 2 cores).
        try:
            from mii_async.workers.engine import Engine

            self.engine = eng = Engine(config)
            self._loop = self._loop_mod.EngineLoop(eng, self._on_output)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            loaded.set_exception(exc)
            return
        loaded.set_result(eng)
        try:
            self._loop.run(self._receive)
        finally:
            eng.close()

    def _receive(self, timeout: float | None) -> Any:
        """The loop's next command: waits for one while idle (`timeout` None), else takes only what is there."""
        try:
            cmd, sink = self._inbox.get() if timeout is None else self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if sink is not None:
            self._sinks[cmd.req_id] = sink
        return cmd

    def _on_output(self, out: Any) -> None:
        api = self._loop_mod
        if isinstance(out, api.Tokens):
            for tok in out.outputs:
                sink = self._sinks.get(tok.req_id)
                if sink is not None and self._deliver(tok.req_id, sink, tok) and tok.finish_reason is not None:
                    del self._sinks[tok.req_id]
        elif isinstance(out, api.RequestEnded):
            sink = self._sinks.pop(out.req_id, None)
            if sink is not None:
                self._deliver(out.req_id, sink, Ended(out.reason, out.message, out.param))
        elif isinstance(out, api.Stats):
            if out.tag is not None:                 # the Future of `stats` or of `reset_prefix_cache`
                out.tag.set_result(out.stats if out.forgotten is None else out.forgotten)

    def _deliver(self, req_id: int, sink: Sink, ev: Any) -> bool:
        try:
            sink(ev)
            return True
        except Exception:  # noqa: BLE001 - the consumer is gone (closed loop): drop its request
            self._sinks.pop(req_id, None)
            self._loop.handle(self._loop_mod.Abort(req_id))
            return False
