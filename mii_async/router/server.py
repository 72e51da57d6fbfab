"""Router: the deployment's front process — the sockets, the lifecycle and the clients' loop around the core.

One asyncio loop (uvloop) owns two ROUTER sockets: one for clients, one for workers. What a request goes
through (admission, balancing, Deltas, ending) is the core's (core.py), which holds no socket: this module
feeds it each client message, encodes prompts (chats with their tools) on a thread (never on the loop) and
writes out what the core has to send, in order, after each event. The workers' socket is read by worker_link.py,
the clock by supervisor.py (dead replicas, silent clients), each through the same `flush`. Queries (ping,
health, stats, reset_prefix_cache) and a client's Shutdown are answered here.

Failure handling: a bad frame or a bad request gets an ErrorReply and the loop carries on. `shutdown(drain_s)`
refuses new work, lets live requests finish up to `drain_s`, aborts the rest (finish_reason "abort"), stops
the workers and returns.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from .. import protocol as P
from ..config import EngineConfig, ServeConfig
from ..errors import InvalidParameterError
from ..mesh_keys import deployment_keys_dir, ensure_keys, publish, unpublish
from ..transport import RouterSocket, start_authenticator
from .admission import Admission
from .background_queue import BackgroundQueue
from .balancer import Balancer
from .core import Encode, RouterCore, ToClient
from .encoder_pool import EncoderPool
from .parallel_plan import check_tensor_parallel, plan_tensor_parallel
from .replicas import ReplicaSet
from .stats_queries import RESET_TIMEOUT_S, StatsQueries
from .supervisor import Supervisor
from .worker_link import Assignment, WorkerLink

log = logging.getLogger("mii_async.router")


class Router:
    def __init__(self, serve: ServeConfig, engine: EngineConfig) -> None:
        self.serve_cfg, self.engine_cfg = serve, engine
        self.ctx = zmq.asyncio.Context()
        # The mesh's keys (mesh_keys.py): the caller's directory, completed, or one made for this deployment.
        self._own_keys = not serve.curve_dir
        self.keys_dir = ensure_keys(serve.curve_dir) if serve.curve_dir else deployment_keys_dir()
        self._auth = start_authenticator(self.ctx, self.keys_dir)
        self.clients = _bind(self.ctx, "port", serve.host, serve.port, self.keys_dir, "clients")
        self.workers_sock = _bind(self.ctx, "worker_port", serve.worker_host, serve.worker_port, self.keys_dir,
                                  "workers")
        self.address = self.clients.address
        self.worker_address = self.workers_sock.address
        self._ports = [int(a.rsplit(":", 1)[1]) for a in (self.address, self.worker_address)]
        publish(self.keys_dir, self._ports)
        local = self.worker_address.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
        self.tensor_parallel = 1 if serve.tensor_parallel == "auto" else int(serve.tensor_parallel)   # set in start()
        self.replicas = ReplicaSet(self.tensor_parallel, local, self.keys_dir)
        self.core = RouterCore(self.replicas, Balancer(engine.cache.block_size),
                               Admission(serve.max_queued_requests, serve.max_queued_tokens),
                               background=BackgroundQueue(serve.max_background_per_replica, engine.scheduler))
        self.stats_queries = StatsQueries(self.replicas, self.workers_sock)
        self.supervisor = Supervisor(self.core, serve, self.flush, self.stats_queries.replica_gone)
        self.worker_link = WorkerLink(self.workers_sock, self.core,
                                      Assignment(engine.to_dict(), serve.heartbeat_s, serve.heartbeat_timeout_s),
                                      self.stats_queries, self.flush, self.supervisor.replica_died)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mii_async-start")
        self.encoders = EncoderPool()
        self._tasks: list[asyncio.Task] = []
        self._pending: set[asyncio.Task] = set()     # encodings and query answers in flight
        self._stopped = asyncio.Event()
        self._shutdown_task: asyncio.Task | None = None
        self._drain_deadline = 0.0

    @property
    def state(self) -> str:
        """starting | ready | draining | stopped."""
        return self.core.state

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resolves (and if need be converts) the model, starts the replicas, then loads the tokenizers."""
        from ..model_source import resolve_model

        loop = asyncio.get_running_loop()
        mc = self.engine_cfg.model
        path = await loop.run_in_executor(self._pool, resolve_model, mc.model, mc.cache_dir)
        self.model_path = path
        world = self.serve_cfg.tensor_parallel
        if world == "auto":
            world, why = await loop.run_in_executor(self._pool, plan_tensor_parallel, path, mc.dtype, mc.device, None,
                                                    mc.quantization)
            log.info("tensor parallel plan: %s", why)
        elif world > 1:
            check_tensor_parallel(path, world)
        self.replicas.tensor_parallel = self.tensor_parallel = int(world)
        if self.state != "starting":                  # a signal arrived while resolving: start nothing
            return
        # The workers first: their start (torch's import, the weights) is the long part, and transformers'
        # import and the tokenizers' load happen meanwhile. Clients are served once the tokenizers are in place.
        self._tasks = [asyncio.create_task(self.worker_link.run(), name="workers"),
                       asyncio.create_task(self.supervisor.run(), name="health")]
        for i in range(self.serve_cfg.replicas):
            self.replicas.start_local(i)
        tokenizers = await loop.run_in_executor(self._pool, _load_tokenizers, path, self.encoders.threads + 1)
        if self.state != "starting":                  # shutting down already: the workers are being stopped
            return
        self.encoders.start(tokenizers[1:])
        self.core.tokenizer = tokenizers[0]
        self._tasks.append(asyncio.create_task(self._client_loop(), name="clients"))

    async def wait_ready(self) -> None:
        """Returns once every local replica is ready or has failed; raises when none is ready."""
        while any(r.state == "starting" and r.local for r in self.replicas.replicas.values()):
            await asyncio.sleep(0.05)
        if self.state != "starting":
            return                                     # shut down while starting
        if self.serve_cfg.replicas and not self.replicas.ready():
            errors = self.worker_link.load_errors
            code, msg = errors[0] if errors else (
                "unavailable", "; ".join(f"replica {r.index}: {r.error}" for r in self.replicas.replicas.values()))
            raise StartupError(code, msg)
        if self.state == "starting":
            self.core.state = "ready"
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
        self.core.state = "draining"
        log.info("shutting down: draining %d request(s) for up to %.1f s", len(self.core.requests), drain_s)
        self._drain_deadline = time.monotonic() + drain_s
        while len(self.core.requests) and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.05)
        self.core.abort_all("the deployment is shutting down")
        await self.flush()
        for rep in self.replicas.replicas.values():
            for w in rep.workers.values():
                await self.workers_sock.send(w.name.encode(), P.Shutdown())
            if rep.state in ("starting", "ready"):
                rep.state = "stopping"
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, c.stop, 10.0) for c in self.replicas.all_children()))
        for t in [*self._tasks, *self._pending]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._pending, return_exceptions=True)
        self.clients.close(linger_s=1.0)      # the final deltas still leave
        self.workers_sock.close()
        self._auth.stop()
        unpublish(self.keys_dir, self._ports, remove=self._own_keys)
        self._pool.shutdown(wait=False)
        self.encoders.close()
        self.core.state = "stopped"
        self._stopped.set()

    async def flush(self) -> None:
        """Writes out what the core has to send, oldest first, each on its socket. One message that cannot be
        sent (too large for a frame) is logged and dropped; the others still leave."""
        sends = self.core.sends
        while sends:
            to = sends.popleft()
            sock = self.clients if isinstance(to, ToClient) else self.workers_sock
            try:
                await sock.send(to.peer, to.msg)
            except P.FrameTooLarge:
                log.exception("a %s for %r could not be sent", type(to.msg).__name__, to.peer)

    # -- clients -------------------------------------------------------------------------------------
    async def _client_loop(self) -> None:
        while True:
            peer, msg, role = await self.clients.recv()
            self.core.heard_from(peer, time.monotonic())
            try:
                await self._on_client(peer, msg, role)
            except Exception:  # noqa: BLE001 - never let one message stop the router
                log.exception("error handling a client message")
            await self.flush()

    async def _on_client(self, peer: bytes, msg: Any, role: str) -> None:
        if isinstance(msg, (P.Query, P.Shutdown)) and role != "operator" and _needs_operator(msg):
            what = "Shutdown" if isinstance(msg, P.Shutdown) else f"the {msg.what!r} query"
            self.core.counters["refused_control"] += 1
            log.warning("refused %s from a %s's key (%r): it needs the operator's", what, role or "keyless", peer)
            await self.clients.send(peer, P.ErrorReply(
                req_id=getattr(msg, "req_id", None) or "", code="permission_denied",
                message=f"{what} needs the deployment's operator key (operator.key_secret in its keys "
                        "directory); this client holds a client key"))
            return
        if isinstance(msg, P.Query):
            self._spawn(self._answer_query(peer, msg))
        elif isinstance(msg, P.Shutdown):
            await self.clients.send(peer, P.QueryReply(req_id=msg.req_id or "", result={"state": "draining"}))
            self.request_shutdown(msg.drain_s)
        elif (job := self.core.client_message(peer, msg)) is not None:
            self._spawn(self._encode(job))

    async def _encode(self, job: Encode) -> None:
        """Encodes a prompt (a chat with its tools) on the encoder pool (chat templates and long prompts take a
        while) and hands the ids to the core."""
        try:
            done = await self.encoders.encode(job, lambda: self.core.requests.get(job.rid) is not None)
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer error on odd input: the request is refused
            self.core.encode_failed(job.rid, exc)
        else:
            if done is None:
                return                                # the request ended while it waited
            text, ids = done
            self.core.encoded(job.rid, text, ids, fit_context=job.fit_context)
        await self.flush()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _answer_query(self, peer: bytes, msg: P.Query) -> None:
        if msg.what == "ping":
            # the requests this router holds for the pinging client: one it does not list was lost
            result: dict = {"live": self.core.requests.of_client(peer)}
        elif msg.what == "health":
            result = self.health()
        elif msg.what == "stats":
            result = await self.stats()
        elif msg.what == "reset_prefix_cache":
            result = await self.stats(reset_prefix_cache=True)
            if result["unanswered"]:          # a rerun would find that replica's prompts cached: not a success
                names = ", ".join(map(str, result["unanswered"]))
                await self.clients.send(peer, P.ErrorReply(
                    req_id=msg.req_id, code="unavailable", message=f"reset_prefix_cache: replica {names} did not "
                    f"answer within {RESET_TIMEOUT_S:g} s ({result.get('prefix_blocks_forgotten', 0)} blocks "
                    "forgotten by the others)"))
                return
        else:
            await self.clients.send(peer, P.ErrorReply(req_id=msg.req_id, code="invalid_parameter",
                                                       message=f"what: unknown query {msg.what!r}", param="what"))
            return
        await self.clients.send(peer, P.QueryReply(req_id=msg.req_id, result=result))

    def model_name(self) -> str:
        """The name to serve the model under: what the caller named (a directory's own name), or the default's."""
        from ..model_source import DEFAULT_MODEL_NAME

        named = self.engine_cfg.model.model
        return os.path.basename(str(named).rstrip("/")) if named else DEFAULT_MODEL_NAME

    def health(self) -> dict:
        core = self.core
        state = core.state if core.state != "ready" or self.replicas.ready() else "unavailable"
        return {"state": state, "protocol_version": P.PROTOCOL_VERSION, "tensor_parallel": self.tensor_parallel,
                "model": str(getattr(self, "model_path", "")), "model_name": self.model_name(),
                "address": self.address, "worker_address": self.worker_address,
                "limits": lim.to_dict() if (lim := self.replicas.limits()) is not None else None,
                "replicas": [r.describe(core.requests.load(r))
                             for r in sorted(self.replicas.replicas.values(), key=lambda r: r.index)],
                "live_requests": len(core.requests), "queued_tokens": core.requests.queued_tokens,
                "background": core.background.stats(self.replicas.ready()),
                "bad_frames": self.clients.bad_frames + self.workers_sock.bad_frames, **core.counters}

    async def stats(self, reset_prefix_cache: bool = False) -> dict:
        return await self.stats_queries.gather(reset_prefix_cache)


OPERATOR_QUERIES = frozenset({"stats", "reset_prefix_cache"})


def _needs_operator(msg: P.Query | P.Shutdown) -> bool:
    """Control messages: stopping the deployment, and queries that reveal or change every replica's state."""
    return isinstance(msg, P.Shutdown) or msg.what in OPERATOR_QUERIES


def _bind(ctx: Any, param: str, host: str, port: int, keys_dir: str, domain: str) -> RouterSocket:
    """A bound ROUTER socket; an address that cannot be bound (in use, not this host's) names its option."""
    try:
        return RouterSocket(ctx, f"tcp://{host}:{port}", keys_dir, domain)
    except zmq.ZMQError as exc:
        raise InvalidParameterError(param, f"cannot listen on tcp://{host}:{port}: {exc.strerror}") from None


class StartupError(Exception):
    """No replica could start: `code` is the first load failure's (or "unavailable")."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


def _load_tokenizers(path: Path, n: int) -> list[Any]:
    """`n` instances of the model's tokenizer: one per encoding thread and one for the loop's decoding (a fast
    tokenizer must not be used by two threads at once), copies of one loaded instance."""
    from transformers import AutoTokenizer

    first = AutoTokenizer.from_pretrained(str(path))
    return [first] + [copy.deepcopy(first) for _ in range(n - 1)]
