"""Worker: one worker process's life — hello, load, ready, then the replica leader's engine loop.

The loop owns the Engine and a blocking DEALER socket to the router. Between steps it drains every message
that arrived (requests, aborts, stats queries, shutdown); while the engine has work it never waits on the
socket, and when idle it blocks on it. Each step's sampled tokens go back in one StepTokens message. A bad
request is answered with RequestFailed and never stops the loop; a failed step fails the requests in it.

Heartbeats run on a thread with a socket of their own, so that a long step (a big prefill on a CPU) does not
look like a dead worker; the router echoes each one, and a worker that hears nothing back for
`heartbeat_timeout_s` concludes the router is gone and exits.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
import uuid
from operator import attrgetter
from typing import Any

import zmq

from mii_async import protocol as P
from mii_async.config import EngineConfig
from mii_async.errors import error_code
from mii_async.params import SamplingParams
from mii_async.transport import SyncDealerSocket

log = logging.getLogger("mii_async.worker")
ASSIGN_TIMEOUT_S = 120.0
STATS_REFRESH_S = 0.5        # how stale the counters in a heartbeat may be (StatsQuery answers are fresh)
STEP_FRAME_BYTES = 4 * 2**20 # prompt logprobs in one StepTokens at most, unless one request's alone are more


class Worker:
    def __init__(self, router: str, replica: int = -1, rank: int = 0, curve_dir: str | None = None,
                 cache_dir: str | None = None) -> None:
        self.router, self.replica, self.rank = router, replica, rank
        self.curve_dir, self.cache_dir = curve_dir, cache_dir
        self.name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ctx = zmq.Context()
        self.sock = SyncDealerSocket(self.ctx, router, self.name.encode(), curve_dir)
        self.engine: Any = None
        self.stats: dict[str, int] = {}     # the latest engine counters, read by the heartbeat thread
        self._stop = threading.Event()
        self._stats_at = 0.0

    def request_stop(self, *_: Any) -> None:
        self._stop.set()

    # -- lifecycle -----------------------------------------------------------------------------------
    def run(self) -> int:
        """Returns the process exit status: 0 after a Shutdown or a signal, 1 when loading failed."""
        try:
            assign = self._handshake()
            if assign is None:
                return 3
            if not self._load(assign):
                return 1
            hb = threading.Thread(target=self._heartbeats, args=(assign,), name="mii_async-heartbeat", daemon=True)
            hb.start()
            try:
                if self.rank == 0:
                    self._loop()
                    self.engine.stop_followers()
                else:
                    self.engine.follow()      # until rank 0 stops; if rank 0 dies, the router cuts our lifeline
            finally:
                self._stop.set()
                hb.join(timeout=assign.heartbeat_s + 1.0)
                self.engine.close()
                if self.engine.tp is not None:
                    self.engine.tp.close()
            return 0
        finally:
            self.sock.close()
            self.ctx.term()

    def _handshake(self) -> P.Assign | None:
        self.sock.send(P.Hello(self.name, self.replica, self.rank, os.getpid(), socket.gethostname()))
        deadline = time.monotonic() + ASSIGN_TIMEOUT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            msg = self.sock.recv(0.5)
            if isinstance(msg, P.Assign):
                self.replica = msg.replica
                return msg
            if isinstance(msg, P.Shutdown):
                log.error("the router at %s refused this worker (rank %d): it has no place for it, or is "
                          "stopping; the router's log says which", self.router, self.rank)
                return None
        log.error("no answer from the router at %s within %.0f s", self.router, ASSIGN_TIMEOUT_S)
        return None

    def _load(self, assign: P.Assign) -> bool:
        config = EngineConfig.from_dict(assign.config)
        if self.cache_dir:
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, cache_dir=self.cache_dir))
        try:
            from .engine import Engine

            config = _pick_device(config, assign.device_index)
            tp = None
            if assign.tensor_parallel > 1:
                import torch

                from .model.parallel import TPGroup

                dev = config.model.device if config.model.device != "auto" else (
                    "cuda" if torch.cuda.is_available() else "cpu")
                tp = TPGroup(self.rank, assign.tensor_parallel, assign.dist_init, torch.device(dev))
            self.engine = Engine(config, tp=tp)
        except Exception as exc:  # noqa: BLE001 - any load failure is reported to the router, then we exit
            log.exception("replica %d rank %d failed to load the model", self.replica, self.rank)
            self.sock.send(P.LoadFailed(self.replica, error_code(exc), f"{type(exc).__name__}: {exc}"))
            time.sleep(0.5)   # let the frame leave before the socket closes
            return False
        eng = self.engine
        self.stats = eng.stats()
        info = {**eng.limits.to_dict(), "num_blocks": eng.num_blocks, "block_size": eng.config.cache.block_size,
                "model": str(eng.model_path), "device": str(eng.device), "dtype": str(eng.dtype).removeprefix("torch."),
                "load_seconds": round(eng.load_seconds, 3), "pid": os.getpid(), "worker": self.name,
                "peak_rss_mib": _peak_rss_mib(), "tensor_parallel": assign.tensor_parallel}
        self.sock.send(P.Ready(self.replica, self.rank, info))
        log.info("replica %d rank %d ready: %s on %s, %d KV blocks", self.replica, self.rank, eng.model_path.name,
                 eng.device, eng.num_blocks)
        return True

    # -- the leader's loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            msg = self.sock.recv(0.0 if eng.has_work() else 0.5)
            while msg is not None:
                self._handle(msg)
                msg = self.sock.recv(0.0)
            if eng.has_work() and not self._stop.is_set():
                self._step()

    def _handle(self, msg: P.Message | P.ProtocolError) -> None:
        eng = self.engine
        if isinstance(msg, P.AddRequest):
            try:
                if msg.req_id in eng.seqs:
                    raise ValueError(f"request {msg.req_id} is already live")
                eng.add_request(msg.req_id, msg.prompt_ids, SamplingParams.from_kwargs(**msg.params))
            except Exception as exc:  # noqa: BLE001 - one bad request is answered, never stops the loop
                self.sock.send(P.RequestFailed(msg.req_id, f"{type(exc).__name__}: {exc}"))
        elif isinstance(msg, P.AbortRequest):
            eng.abort(msg.req_id)
        elif isinstance(msg, P.StatsQuery):
            forgotten = eng.reset_prefix_cache() if msg.reset_prefix_cache else None
            self.stats = eng.stats()
            report = self.stats if forgotten is None else {**self.stats, "prefix_blocks_forgotten": forgotten}
            self.sock.send(P.StatsReport(msg.token, self.replica, report))
        elif isinstance(msg, P.Shutdown):
            log.info("replica %d rank %d: shutdown", self.replica, self.rank)
            self._stop.set()
        elif isinstance(msg, P.ProtocolError):
            log.warning("bad frame from the router: %s", msg)
        else:
            log.warning("unexpected %s from the router", type(msg).__name__)

    def _step(self) -> None:
        eng = self.engine
        try:
            # The step in flight's tokens go out as soon as they are read, which may be during this launch.
            self._send_tokens(eng.step(emit=self._send_tokens))
        except Exception as exc:  # noqa: BLE001 - fail the live requests, keep serving
            log.exception("engine step failed")
            if eng.tp is not None:
                # The other ranks may be inside this step's collectives: the group is out of step for good.
                # Exit, and the router fails the replica's requests and replaces it.
                os._exit(1)
            for req_id in list(eng.seqs):
                eng.abort(req_id)
                self.sock.send(P.RequestFailed(req_id, f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            for req_id, why, param in eng.take_failed():     # e.g. a guide this model's vocabulary cannot follow
                self.sock.send(P.RequestFailed(req_id, why, param))
        now = time.monotonic()
        if now - self._stats_at > STATS_REFRESH_S:    # for the heartbeats; not worth doing every step
            self.stats, self._stats_at = eng.stats(), now

    def _send_tokens(self, outputs: list) -> None:
        if not outputs:
            return
        # Prompt logprobs come once per request (with its first token) and may be megabytes: a step whose
        # outputs carry them goes out in several StepTokens, each under STEP_FRAME_BYTES (the router refuses a
        # request whose own would not fit a frame).
        if not any(map(_prompt_lps, outputs)):        # the usual step: one pass in C
            self._send_step(outputs, False)
            return
        group: list = []
        size = 0
        for o in outputs:
            add = _packed_bytes(o.prompt_logprobs)
            if group and size + add > STEP_FRAME_BYTES:
                self._send_step(group, True)
                group, size = [], 0
            group.append(o)
            size += add
        self._send_step(group, True)

    def _send_step(self, outputs: list, prompt_lps: bool) -> None:
        lps = [None if (lp := o.logprobs) is None else [lp.logprob, [list(t) for t in lp.top], lp.rank]
               for o in outputs]
        plps = None                                   # packed as the engine gave them: sent as they are
        if prompt_lps:
            plps = [o.prompt_logprobs for o in outputs]
            if all(p is None for p in plps):
                plps = None
        self.sock.send(P.StepTokens([o.req_id for o in outputs], [o.token_id for o in outputs],
                                    [o.finish_reason for o in outputs], [o.cached_tokens for o in outputs],
                                    lps if any(lp is not None for lp in lps) else None, plps))

    # -- heartbeat thread ----------------------------------------------------------------------------
    def _heartbeats(self, assign: P.Assign) -> None:
        hb = SyncDealerSocket(self.ctx, self.router, (self.name + "/hb").encode(), self.curve_dir)
        last_echo = time.monotonic()
        try:
            while not self._stop.is_set():
                hb.send(P.Heartbeat(self.replica, dict(self.stats)))
                deadline = time.monotonic() + assign.heartbeat_s
                while (left := deadline - time.monotonic()) > 0:
                    if isinstance(hb.recv(left), P.Heartbeat):
                        last_echo = time.monotonic()
                if time.monotonic() - last_echo > assign.heartbeat_timeout_s:
                    log.error("the router at %s has not answered for %.0f s: exiting", self.router,
                              assign.heartbeat_timeout_s)
                    os._exit(3)
        finally:
            hb.close()


_prompt_lps = attrgetter("prompt_logprobs")     # a PromptLogprobs (a non-empty tuple) when set


def _packed_bytes(plps: P.PromptLogprobs | None) -> int:
    """One output's prompt logprobs on the wire: their four arrays and a few bytes of msgpack headers."""
    if plps is None:
        return 0
    return 32 + len(plps.own) + len(plps.top_ids) + len(plps.top_logprobs) + len(plps.ranks)


def _peak_rss_mib() -> int:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _pick_device(config: EngineConfig, device_index: int) -> EngineConfig:
    """With several local GPUs, replica r rank k takes GPU (r·T + k) mod count."""
    import torch

    dev = config.model.device
    if dev in ("auto", "cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        dev = f"cuda:{device_index % torch.cuda.device_count()}"
        torch.cuda.set_device(dev)
        return dataclasses.replace(config, model=dataclasses.replace(config.model, device=dev))
    return config


def install_signal_handlers(worker: Worker, supervised: bool = False) -> None:
    """SIGTERM and SIGINT stop a worker started by hand. One the router started (`supervised`: it has a
    lifeline) leaves them to the router: a terminal's Ctrl-C, or systemd stopping the unit, signals the
    whole group at once, and the router drains its requests before it tells the workers to stop. The
    lifeline still ends the worker when the router is gone."""
    def ignore(signum: int, _: Any) -> None:
        log.info("%s: the router drives this worker's shutdown", signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, ignore if supervised else worker.request_stop)
