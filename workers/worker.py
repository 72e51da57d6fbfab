"""Worker: one worker process's life — hello, load, ready, then the replica leader's engine loop.

The leader drives an EngineLoop (`engine_loop.py`) over a blocking DEALER socket to the router: router
messages become the loop's commands (requests, aborts, stats queries, shutdown), and its outputs go back as
StepTokens (one message per step, or several when prompt logprobs are large), RequestFailed and StatsReport.
While the engine has work the loop never waits on the socket; idle, it waits up to half a second, so that a
signal is seen.

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
from typing import TYPE_CHECKING, Any

import zmq

from mii_async import protocol as P
from mii_async.config import EngineConfig
from mii_async.errors import error_code
from mii_async.outputs import FinishReason
from mii_async.params import SamplingParams
from mii_async.transport import SyncDealerSocket

from .engine_loop import Abort, AddRequest, Command, EngineLoop, Output, QueryStats, RequestEnded, Stats, Stop, Tokens

if TYPE_CHECKING:
    from .engine import EngineOutput

log = logging.getLogger("mii_async.worker")
ASSIGN_TIMEOUT_S = 120.0
IDLE_POLL_S = 0.5            # how long an idle leader waits on its socket before it looks at its stop flag
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
                    self._serve()
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
        self.sock.send(P.Hello(worker=self.name, replica=self.replica, rank=self.rank, pid=os.getpid(),
                               host=socket.gethostname()))
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
            self.sock.send(P.LoadFailed(replica=self.replica, code=error_code(exc),
                                        message=f"{type(exc).__name__}: {exc}"))
            time.sleep(0.5)   # let the frame leave before the socket closes
            return False
        eng = self.engine
        self.stats = eng.stats()
        info = {**eng.limits.to_dict(), "num_blocks": eng.num_blocks, "block_size": eng.config.cache.block_size,
                "model": str(eng.model_path), "device": str(eng.device), "dtype": str(eng.dtype).removeprefix("torch."),
                "load_seconds": round(eng.load_seconds, 3), "pid": os.getpid(), "worker": self.name,
                "peak_rss_mib": _peak_rss_mib(), "tensor_parallel": assign.tensor_parallel,
                "max_num_seqs": eng.config.scheduler.max_num_seqs}
        self.sock.send(P.Ready(replica=self.replica, rank=self.rank, info=info))
        log.info("replica %d rank %d ready: %s on %s, %d KV blocks", self.replica, self.rank, eng.model_path.name,
                 eng.device, eng.num_blocks)
        return True

    # -- the leader's loop ---------------------------------------------------------------------------
    def _serve(self) -> None:
        loop = EngineLoop(self.engine, self._on_output, stats_refresh_s=STATS_REFRESH_S)
        try:
            loop.run(self._receive)
        except Exception:
            if self.engine.tp is None:
                raise
            # The other ranks may be inside a failed step's collectives: the group is out of step for good.
            # Exit, and the router fails the replica's requests and replaces it.
            log.exception("replica %d: the leader's loop failed", self.replica)
            os._exit(1)

    def _receive(self, timeout: float | None) -> Command | None:
        """The next command from the router within `timeout` s, or None; Stop once the worker is stopping.
        Idle (`timeout` None), it waits IDLE_POLL_S at most, so that a signal's stop is seen."""
        while not self._stop.is_set():
            msg = self.sock.recv(IDLE_POLL_S if timeout is None else timeout)
            if msg is None:
                return None
            timeout = 0.0                             # a message that is no command: only what is there
            if isinstance(msg, P.AddRequest):       # checked by the router: taken as they are
                return AddRequest(msg.req_id, msg.prompt_ids, SamplingParams.from_wire(msg.params, trusted=True))
            if isinstance(msg, P.AbortRequest):
                return Abort(msg.req_id)
            if isinstance(msg, P.StatsQuery):
                return QueryStats(msg.token, msg.reset_prefix_cache)
            if isinstance(msg, P.Shutdown):
                log.info("replica %d rank %d: shutdown", self.replica, self.rank)
                self._stop.set()
            elif isinstance(msg, P.ProtocolError):
                log.warning("bad frame from the router: %s", msg)
            else:
                log.warning("unexpected %s from the router", type(msg).__name__)
        return Stop("the worker is stopping")

    def _on_output(self, out: Output) -> None:
        if isinstance(out, Tokens):
            self._send_tokens(out.outputs)
        elif isinstance(out, RequestEnded):
            if out.reason == FinishReason.ERROR:      # (the router ended the aborted ones itself)
                self.sock.send(P.RequestFailed(req_id=out.req_id, message=out.message or "", param=out.param))
        elif isinstance(out, Stats):
            self.stats = out.stats                    # for the heartbeats
            if out.tag is not None:
                report = (out.stats if out.forgotten is None
                          else {**out.stats, "prefix_blocks_forgotten": out.forgotten})
                self.sock.send(P.StatsReport(token=out.tag, replica=self.replica, stats=report))

    def _send_tokens(self, outputs: list[EngineOutput]) -> None:
        if not outputs:
            return
        # Prompt logprobs come once per request (with its first token) and may be megabytes: a step whose
        # outputs carry them goes out in several StepTokens, each under STEP_FRAME_BYTES (the router refuses a
        # request whose own would not fit a frame).
        if not any(map(_prompt_lps, outputs)):        # the usual step: one pass in C
            self._send_step(outputs, False)
            return
        group: list[EngineOutput] = []
        size = 0
        for o in outputs:
            add = _packed_bytes(o.prompt_logprobs)
            if group and size + add > STEP_FRAME_BYTES:
                self._send_step(group, True)
                group, size = [], 0
            group.append(o)
            size += add
        self._send_step(group, True)

    def _send_step(self, outputs: list[EngineOutput], prompt_lps: bool) -> None:
        lps = [None if (lp := o.logprobs) is None else lp.to_wire() for o in outputs]
        plps = None                                   # packed as the engine gave them: sent as they are
        if prompt_lps:
            plps = [o.prompt_logprobs for o in outputs]
            if all(p is None for p in plps):
                plps = None
        self.sock.send(P.StepTokens(req_ids=[o.req_id for o in outputs], token_ids=[o.token_id for o in outputs],
                                    finish_reasons=[o.finish_reason for o in outputs],
                                    cached_tokens=[o.cached_tokens for o in outputs],
                                    logprobs=lps if any(lp is not None for lp in lps) else None,
                                    prompt_logprobs=plps))

    # -- heartbeat thread ----------------------------------------------------------------------------
    def _heartbeats(self, assign: P.Assign) -> None:
        hb = SyncDealerSocket(self.ctx, self.router, (self.name + "/hb").encode(), self.curve_dir)
        last_echo = time.monotonic()
        try:
            while not self._stop.is_set():
                hb.send(P.Heartbeat(replica=self.replica, stats=dict(self.stats)))
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
