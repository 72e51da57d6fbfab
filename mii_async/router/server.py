"""Router: the deployment's front process — clients in, replicas out, tokens streamed back.

One asyncio loop (uvloop) owns two ROUTER sockets: one for clients, one for workers. For each Generate it
validates the parameters, tokenizes on a thread (never on the loop), checks the request against the replicas'
limits and the admission bounds, picks a replica (balancer.py) and forwards the ids. Each StepTokens from a
replica leader is detokenized per request (UTF-8 safe, stop strings) and streamed to the client as Deltas.
A stop string ends a request here, and the replica is told to abort it.

The workers' socket (handshakes, heartbeats, step tokens) is worker_link.py's. Failure handling: a bad frame
or a bad request gets an ErrorReply and the loop carries on; dead replicas and silent clients are the
supervisor's (supervisor.py). `shutdown(drain_s)` refuses new work, lets live requests finish up to
`drain_s`, aborts the rest (finish_reason "abort"), stops the workers and returns.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from .. import protocol as P
from ..config import EngineConfig, ServeConfig
from ..errors import (InvalidParameterError, MIIAsyncError, OverloadedError, RequestTooLongError, UnavailableError,
                      error_code)
from ..packed import prompt_logprobs_bytes
from ..params import SamplingParams
from ..transport import RouterSocket, start_authenticator
from .balancer import Balancer, Candidate
from .parallel_plan import check_tensor_parallel, plan_tensor_parallel
from ..text.prompts import PromptEncoder
from .replicas import Replica, ReplicaSet
from .supervisor import Supervisor
from .worker_link import WorkerLink
from ..text.request_state import Ended, RequestState
from .stats_queries import RESET_TIMEOUT_S, StatsQueries

log = logging.getLogger("mii_async.router")


@dataclass
class _Live:
    rid: int                          # router-wide request number (the workers' req_id)
    peer: bytes                       # the client's routing id
    creq: str                         # the client's req_id
    state: RequestState | None = None  # None while tokenizing
    replica: Replica | None = None
    cost: int = 0                     # prompt + max_new_tokens, counted against max_queued_tokens


class Router:
    def __init__(self, serve: ServeConfig, engine: EngineConfig) -> None:
        self.serve_cfg, self.engine_cfg = serve, engine
        self.ctx = zmq.asyncio.Context()
        self._auth = start_authenticator(self.ctx, serve.curve_dir) if serve.curve_dir else None
        self.clients = _bind(self.ctx, "port", serve.host, serve.port, serve.curve_dir)
        self.workers_sock = _bind(self.ctx, "worker_port", serve.worker_host, serve.worker_port, serve.curve_dir)
        self.address = self.clients.address
        self.worker_address = self.workers_sock.address
        local = self.worker_address.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
        self.tensor_parallel = 1 if serve.tensor_parallel == "auto" else int(serve.tensor_parallel)   # set in start()
        self.replicas = ReplicaSet(self.tensor_parallel, local, serve.curve_dir)
        self.balancer = Balancer(engine.cache.block_size)
        self.stats_queries = StatsQueries(self.replicas, self.workers_sock)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mii_async-tokenize")
        self._rids = itertools.count()
        self.live: dict[int, _Live] = {}
        self._by_client: dict[tuple[bytes, str], int] = {}
        self.client_seen: dict[bytes, float] = {}
        self.queued_tokens = 0
        self.state = "starting"           # starting | ready | draining | stopped
        self.startup_errors: list[tuple[str, str]] = []    # (code, message) of replicas that failed to load
        self.counters = {"requests": 0, "rejected": 0, "overloaded": 0, "failed": 0, "replica_deaths": 0}
        self.supervisor = Supervisor(self)
        self.worker_link = WorkerLink(self)
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self._shutdown_task: asyncio.Task | None = None
        self._drain_deadline = 0.0

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Loads the tokenizer (resolving, and if need be converting, the model), then starts the replicas."""
        from transformers import AutoTokenizer

        from ..model_source import resolve_model

        loop = asyncio.get_running_loop()
        mc = self.engine_cfg.model
        path = await loop.run_in_executor(self._pool, resolve_model, mc.model, mc.cache_dir)
        self.model_path = path
        world = self.serve_cfg.tensor_parallel
        if world == "auto":
            world, why = await loop.run_in_executor(self._pool, plan_tensor_parallel, path, mc.dtype, mc.device)
            log.info("tensor parallel plan: %s", why)
        elif world > 1:
            check_tensor_parallel(path, world)
        self.replicas.tensor_parallel = self.tensor_parallel = int(world)
        # Two instances: encoding runs on the pool thread, decoding on the loop, and a fast tokenizer must
        # not be used by two threads at once.
        self.encoder = PromptEncoder(await loop.run_in_executor(self._pool, AutoTokenizer.from_pretrained, str(path)))
        self.tokenizer = await loop.run_in_executor(self._pool, AutoTokenizer.from_pretrained, str(path))
        if self.state != "starting":                  # a signal arrived while loading: start nothing
            return
        self._tasks = [asyncio.create_task(self._client_loop(), name="clients"),
                       asyncio.create_task(self.worker_link.run(), name="workers"),
                       asyncio.create_task(self.supervisor.run(), name="health")]
        for i in range(self.serve_cfg.replicas):
            self.replicas.start_local(i)

    async def wait_ready(self) -> None:
        """Returns once every local replica is ready or has failed; raises when none is ready."""
        while any(r.state == "starting" and r.local for r in self.replicas.replicas.values()):
            await asyncio.sleep(0.05)
        if self.state != "starting":
            return                                     # shut down while starting
        if self.serve_cfg.replicas and not self.replicas.ready():
            code, msg = self.startup_errors[0] if self.startup_errors else (
                "unavailable", "; ".join(f"replica {r.index}: {r.error}" for r in self.replicas.replicas.values()))
            raise _StartupError(code, msg)
        if self.state == "starting":
            self.state = "ready"
        log.info("router ready on %s (workers on %s), %d replica(s)", self.address, self.worker_address,
                 len(self.replicas.ready()))

    async def serve_forever(self) -> None:
        await self._stopped.wait()

    def request_shutdown(self, drain_s: float) -> asyncio.Task:
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.create_task(self.shutdown(drain_s))
        return self._shutdown_task

    def stop_draining(self) -> None:
        """Ends a drain in progress now (a second SIGINT)."""
        self._drain_deadline = 0.0

    async def shutdown(self, drain_s: float) -> None:
        """Drains up to `drain_s`, aborts what is left, stops the workers and closes the sockets."""
        if self.state in ("draining", "stopped"):
            return
        self.state = "draining"
        log.info("shutting down: draining %d request(s) for up to %.1f s", len(self.live), drain_s)
        self._drain_deadline = time.monotonic() + drain_s
        while self.live and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.05)
        for live in list(self.live.values()):
            await self.end(live, Ended("abort", "the deployment is shutting down"), tell_replica=True)
        for rep in self.replicas.replicas.values():
            for w in rep.workers.values():
                await self.workers_sock.send(w.name.encode(), P.Shutdown())
            if rep.state in ("starting", "ready"):
                rep.state = "stopping"
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, c.stop, 10.0) for c in self.replicas.all_children()))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.clients.close(linger_s=1.0)      # the final deltas still leave
        self.workers_sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._pool.shutdown(wait=False)
        self.state = "stopped"
        self._stopped.set()

    # -- clients -------------------------------------------------------------------------------------
    async def _client_loop(self) -> None:
        while True:
            peer, msg = await self.clients.recv()
            self.client_seen[peer] = time.monotonic()
            try:
                await self._on_client(peer, msg)
            except Exception:  # noqa: BLE001 - never let one message stop the router
                log.exception("error handling a client message")

    async def _on_client(self, peer: bytes, msg: Any) -> None:
        if isinstance(msg, P.Generate):
            await self._on_generate(peer, msg)
        elif isinstance(msg, P.Abort):
            rid = self._by_client.get((peer, msg.req_id))
            if rid is not None:
                await self.end(self.live[rid], Ended("abort"), tell_replica=True)
        elif isinstance(msg, P.Query):
            asyncio.create_task(self._answer_query(peer, msg))
        elif isinstance(msg, P.Shutdown):
            await self.clients.send(peer, P.QueryReply(msg.req_id or "", {"state": "draining"}))
            self.request_shutdown(msg.drain_s)
        elif isinstance(msg, P.ProtocolError):       # under the refused Generate's id: its stream ends now
            await self.clients.send(peer, P.ErrorReply(msg.req_id, "bad_frame", str(msg)))
        else:
            await self.clients.send(peer, P.ErrorReply(None, "bad_frame", f"a client may not send {type(msg).__name__}"))

    async def _on_generate(self, peer: bytes, msg: P.Generate) -> None:
        self.counters["requests"] += 1
        key = (peer, msg.req_id)
        if key in self._by_client:
            # not under that id, whose live stream the reply would end (AsyncClient never reuses an id)
            await self._refuse(peer, None, InvalidParameterError("req_id", f"{msg.req_id!r} is already live"))
            return
        if self.state != "ready":
            await self._refuse(peer, msg.req_id, UnavailableError(f"the deployment is {self.state}"))
            return
        if len(self.live) >= self.serve_cfg.max_queued_requests:
            await self._refuse(peer, msg.req_id, OverloadedError(
                f"overloaded: {len(self.live)} requests queued (max_queued_requests={self.serve_cfg.max_queued_requests})"))
            return
        live = _Live(next(self._rids), peer, msg.req_id)
        self.live[live.rid] = live
        self._by_client[key] = live.rid
        asyncio.create_task(self._admit(live, msg))

    async def _admit(self, live: _Live, msg: P.Generate) -> None:
        try:
            params = SamplingParams.from_kwargs(**msg.params)
            given = [x for x in (msg.prompt, msg.prompt_ids, msg.messages) if x is not None]
            if len(given) != 1:
                raise InvalidParameterError("prompt", "give exactly one of prompt, prompt_ids and messages")
            text, ids = await asyncio.get_running_loop().run_in_executor(self._pool, self.encoder.encode, given[0])
            if self.live.get(live.rid) is not live:
                return                                  # aborted while tokenizing
            limits = self.replicas.limits()
            if limits is None:
                raise UnavailableError("no replica is ready")
            limits.check(ids, params)
            check_prompt_logprobs_size(len(ids), params)
            cost = len(ids) + params.max_new_tokens
            if self.queued_tokens + cost > self.serve_cfg.max_queued_tokens:
                raise OverloadedError(f"overloaded: {self.queued_tokens} tokens queued, this request adds {cost} "
                                      f"(max_queued_tokens={self.serve_cfg.max_queued_tokens})")
            cands = [Candidate(r.index, self.replica_load(r)) for r in self.replicas.ready()]
            index = self.balancer.pick(cands, ids)
            if index is None:
                raise UnavailableError("no replica is ready")
            rep = self.replicas.replicas[index]
        except MIIAsyncError as exc:
            if self.live.get(live.rid) is live:       # not already ended by an abort
                self.forget(live)
                await self._refuse(live.peer, live.creq, exc)
            return
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer error on odd input
            log.exception("request %s failed before dispatch", live.creq)
            if self.live.get(live.rid) is not live:
                return
            self.forget(live)
            await self._refuse(live.peer, live.creq, InvalidParameterError("prompt", f"could not be encoded: {exc}"))
            return
        live.state = RequestState(self.tokenizer, text, ids, params)   # streams only: keeps no logprobs
        live.replica, live.cost = rep, cost
        rep.requests.add(live.rid)
        self.queued_tokens += cost
        await self.workers_sock.send(rep.leader, P.AddRequest(live.rid, ids, params.to_dict()))

    async def _refuse(self, peer: bytes, creq: str | None, exc: MIIAsyncError) -> None:
        code = error_code(exc)
        self.counters["overloaded" if code == "overloaded" else "rejected"] += 1
        await self.clients.send(peer, P.ErrorReply(creq, code, str(exc), getattr(exc, "param", None)))

    async def _answer_query(self, peer: bytes, msg: P.Query) -> None:
        if msg.what == "ping":
            # the requests this router holds for the pinging client: one it does not list was lost
            result: dict = {"live": [creq for (p, creq) in self._by_client if p == peer]}
        elif msg.what == "health":
            result = self.health()
        elif msg.what == "stats":
            result = await self.stats()
        elif msg.what == "reset_prefix_cache":
            result = await self.stats(reset_prefix_cache=True)
            if result["unanswered"]:          # a rerun would find that replica's prompts cached: not a success
                names = ", ".join(map(str, result["unanswered"]))
                await self.clients.send(peer, P.ErrorReply(
                    msg.req_id, "unavailable", f"reset_prefix_cache: replica {names} did not answer within "
                    f"{RESET_TIMEOUT_S:g} s ({result.get('prefix_blocks_forgotten', 0)} blocks forgotten by the others)"))
                return
        else:
            await self.clients.send(peer, P.ErrorReply(msg.req_id, "invalid_parameter",
                                                       f"what: unknown query {msg.what!r}", "what"))
            return
        await self.clients.send(peer, P.QueryReply(msg.req_id, result))

    def replica_load(self, rep: Replica) -> int:
        """Outstanding tokens: what the replica's live requests may still cost it (prompt + max_new_tokens,
        less what they generated)."""
        total = 0
        for rid in rep.requests:
            live = self.live.get(rid)
            if live is not None and live.state is not None:
                total += live.cost - len(live.state.output_ids)
        return total

    def model_name(self) -> str:
        """The name to serve the model under: what the caller named (a directory's own name), or the default's."""
        from ..model_source import DEFAULT_MODEL_NAME

        named = self.engine_cfg.model.model
        return os.path.basename(str(named).rstrip("/")) if named else DEFAULT_MODEL_NAME

    def health(self) -> dict:
        ready = self.replicas.ready()
        state = self.state if self.state != "ready" or ready else "unavailable"
        return {"state": state, "protocol_version": P.PROTOCOL_VERSION, "tensor_parallel": self.tensor_parallel, "model": str(getattr(self, "model_path", "")),
                "model_name": self.model_name(),
                "address": self.address, "worker_address": self.worker_address,
                "limits": lim.to_dict() if (lim := self.replicas.limits()) is not None else None,
                "replicas": [r.describe(self.replica_load(r)) for r in sorted(self.replicas.replicas.values(), key=lambda r: r.index)],
                "live_requests": len(self.live), "queued_tokens": self.queued_tokens,
                "bad_frames": self.clients.bad_frames + self.workers_sock.bad_frames, **self.counters}

    async def stats(self, reset_prefix_cache: bool = False) -> dict:
        return await self.stats_queries.gather(reset_prefix_cache)

    # -- workers -------------------------------------------------------------------------------------
    async def send_chunk(self, live: _Live, chunk: Any) -> None:
        await self.clients.send(live.peer, self.delta(live, chunk))

    def delta(self, live: _Live, chunk: Any) -> P.Delta:
        """The Delta that streams `chunk` to the request's client (the first one carries the prompt's ids)."""
        lps = None if chunk.logprobs is None else [_wire_logprob(lp) for lp in chunk.logprobs]
        plps = None if chunk.prompt_logprobs is None else [lp and _wire_logprob(lp) for lp in chunk.prompt_logprobs]
        return P.Delta(live.creq, chunk.text, list(chunk.token_ids), lps, chunk.finish_reason,
                       chunk.usage.to_dict() if chunk.usage is not None else None, chunk.error,
                       chunk.prompt_token_ids, plps)

    async def send_deltas(self, peer: bytes, deltas: list[P.Delta]) -> None:
        """One frame for a client: its Delta, or a DeltaBatch of several."""
        await self.clients.send(peer, deltas[0] if len(deltas) == 1 else P.DeltaBatch(deltas))

    async def end(self, live: _Live, ev: Ended, tell_replica: bool) -> None:
        """Ends a live request with an abort or an error, telling the client (and the replica)."""
        self.forget(live)
        if live.state is None:                      # still tokenizing: _admit will see it gone
            if ev.reason == "error":
                code = "generation_failed" if ev.param is None else "invalid_parameter"
                await self.clients.send(live.peer, P.ErrorReply(live.creq, code, ev.error or "error", ev.param))
            else:
                await self.clients.send(live.peer, P.Delta(live.creq, "", [], None, "abort", None, ev.error))
            return
        if tell_replica and live.replica is not None and live.replica.state == "ready":
            await self.workers_sock.send(live.replica.leader, P.AbortRequest(live.rid))
        chunk = live.state.on_event(ev)
        if (refusal := live.state.refusal) is not None:   # nothing streamed yet: refused, as at submission
            await self.clients.send(live.peer,
                                    P.ErrorReply(live.creq, "invalid_parameter", str(refusal), refusal.param))
        elif chunk is not None:
            await self.send_chunk(live, chunk)

    def forget(self, live: _Live) -> None:
        if self.live.pop(live.rid, None) is None:
            return
        self._by_client.pop((live.peer, live.creq), None)
        if live.replica is not None:
            live.replica.requests.discard(live.rid)
            self.queued_tokens -= live.cost


def _bind(ctx: Any, param: str, host: str, port: int, curve_dir: str | None) -> RouterSocket:
    """A bound ROUTER socket; an address that cannot be bound (in use, not this host's) names its option."""
    try:
        return RouterSocket(ctx, f"tcp://{host}:{port}", curve_dir)
    except zmq.ZMQError as exc:
        raise InvalidParameterError(param, f"cannot listen on tcp://{host}:{port}: {exc.strerror}") from None


def _wire_logprob(lp: Any) -> list:
    """A Logprob as a Delta carries it: [token_id, logprob, [[id, logprob], …], rank or None]."""
    return [lp.token_id, lp.logprob, [list(t) for t in lp.top], lp.rank]


def check_prompt_logprobs_size(num_tokens: int, params: SamplingParams) -> None:
    """A request's prompt logprobs travel in one message (with its first token): refuses those that cannot."""
    n = params.prompt_logprobs
    if n is not None and prompt_logprobs_bytes(num_tokens, n) > P.MAX_PROMPT_LOGPROBS_BYTES:
        raise RequestTooLongError("prompt_logprobs", f"the logprobs of a prompt of {num_tokens} tokens with {n} "
                                  f"alternatives each exceed the {P.MAX_PROMPT_LOGPROBS_BYTES >> 20} MiB that one "
                                  "message carries: ask for fewer alternatives or give a shorter prompt")


class _StartupError(Exception):
    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)
