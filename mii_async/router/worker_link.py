"""WorkerLink: the router's side of the workers' socket — handshakes, heartbeats, and each step's tokens.

Hello is answered with Assign (or Shutdown for a worker that has no place: a stray of a dead generation, a
mismatched routing id, a router that is stopping); Ready completes a replica; LoadFailed ends it (for good
when a restart cannot help). Heartbeats are echoed only to registered workers, and an unknown one is told to
stop. Each StepTokens is fed, token by token, to its request's RequestState, and the resulting chunks stream to
the clients, one frame per client per step; tokens of aborted requests and late ones from a dead generation are
dropped. A request's prompt logprobs are checked on their packed bytes (numpy, a few passes) and forwarded to
its client as they came, in a frame of their own; a malformed entry ends only its request.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import protocol as P
from ..params import MAX_TOKEN_ID
from ..text.request_state import Ended

if TYPE_CHECKING:
    from .server import Router

log = logging.getLogger("mii_async.router")
# Load failures that a restart cannot fix (others, such as an out-of-memory while an old process's memory is
# still being freed, get the supervisor's restart with backoff).
PERMANENT_LOAD_ERRORS = ("invalid_parameter", "request_too_long", "model_not_found", "unsupported_model")


# A DeltaBatch is sent once its deltas reach this estimate: first deltas carry their prompt's ids, and a step
# may start hundreds of requests with long (prefix-cached) prompts; the frame limit is 16 MiB.
BATCH_BYTES = 2**20


def _delta_bytes(d: P.Delta) -> int:
    """A Delta's frame size, roughly: 4 bytes a token id, the text, ~24 bytes a logprob entry, the rest (a
    Delta with prompt logprobs goes in a frame of its own)."""
    ids = len(d.token_ids) + (len(d.prompt_ids) if d.prompt_ids is not None else 0)
    lps = sum(3 + len(x[2]) for x in d.logprobs) if d.logprobs else 0
    return 64 + 4 * ids + 4 * len(d.text) + 24 * lps


class _TokenEvent(NamedTuple):      # what RequestState.on_event reads from a sampled token
    token_id: int
    logprobs: Any
    finish_reason: str | None
    cached_tokens: int
    prompt_logprobs: P.PromptLogprobs | None   # on the first token, when asked: checked, still packed


class _Logprobs(NamedTuple):      # a sampled token's logprobs, as RequestState reads them
    logprob: float
    top: list
    rank: int | None = None


def _logprob_entry(x: Any, n: int, vocab_size: int) -> _Logprobs | None:
    """A logprob entry from a worker, [logprob, [[id, logprob], …], rank] with at most `n` alternatives, or None
    when malformed: finite floats (JSON carries no inf or nan), ids that are token ids, a rank in 1 … vocabulary
    (or None)."""
    try:
        lp, top, rank = x
        if not _finite(lp) or not isinstance(top, (list, tuple)) or len(top) > n or not (
                rank is None or (type(rank) is int and 1 <= rank <= vocab_size)):
            return None
        out = []
        for i, v in top:
            if type(i) is not int or not 0 <= i <= MAX_TOKEN_ID or not _finite(v):
                return None
            out.append((i, float(v)))
    except (TypeError, ValueError):
        return None
    return _Logprobs(float(lp), out, rank)


def _finite(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _prompt_logprobs(x: Any, prompt_len: int, n: int, vocab_size: int) -> P.PromptLogprobs | None:
    """A StepTokens entry's prompt logprobs, or None when malformed: PromptLogprobs of one position per prompt
    token after the first, at most `n` alternatives, finite numbers (JSON carries no inf or nan), ids inside
    the vocabulary, ranks in 1 … vocabulary. Checked with numpy on the packed bytes, which then go to the client
    as they came."""
    if type(x) is not P.PromptLogprobs or not x.n <= n or x.num_positions != prompt_len - 1:
        return None                                # (decode checked the shape: lengths agree with n)
    own = np.frombuffer(x.own, "<f4")
    lps = np.frombuffer(x.top_logprobs, "<f4")
    if not (np.isfinite(own).all() and np.isfinite(lps).all()):
        return None
    if lps.size and int(np.frombuffer(x.top_ids, "<u4").max()) >= vocab_size:
        return None
    ranks = np.frombuffer(x.ranks, "<u4")
    if ranks.size and not (int(ranks.min()) >= 1 and int(ranks.max()) <= vocab_size):
        return None
    return x


def _vocab_size(live: Any) -> int:
    """The vocabulary of the replica that serves `live` (a ready one: its leader reported it in Ready)."""
    return live.replica.workers[0].info.get("vocab_size", MAX_TOKEN_ID + 1)


class WorkerLink:
    def __init__(self, router: Router) -> None:
        self.router = router

    async def run(self) -> None:
        r = self.router
        while True:
            peer, msg = await r.workers_sock.recv()
            try:
                await self._on_message(peer, msg)
            except Exception:  # noqa: BLE001
                log.exception("error handling a worker message")

    async def _on_message(self, peer: bytes, msg: Any) -> None:
        r = self.router
        if isinstance(msg, P.StepTokens):
            await self._on_step(peer, msg)
        elif isinstance(msg, P.Heartbeat):
            found = r.replicas.worker(peer.decode(errors="replace").removesuffix("/hb"))
            if found is None:                         # not (or no longer) one of ours: it should stop
                await r.workers_sock.send(peer, P.Shutdown())
                return
            found[0].last_heartbeat = time.monotonic()
            if found[1] == 0:
                found[0].stats = msg.stats
            await r.workers_sock.send(peer, P.Heartbeat(-1, {}))
        elif isinstance(msg, P.RequestFailed):
            live = r.live.get(msg.req_id)
            if live is not None and self._from_replica(peer, live):
                r.counters["failed" if msg.param is None else "rejected"] += 1   # a caller's value: refused
                await r.end(live, Ended("error", msg.message, msg.param), tell_replica=False)
        elif isinstance(msg, P.StatsReport):
            rep = r.replicas.replicas.get(msg.replica) if isinstance(msg.replica, int) else None
            if rep is not None and rep.leader == peer:
                r.stats_queries.on_report(msg)          # only the replica's leader answers for it
            else:
                log.debug("a stats report for replica %r from %r, which is not its leader: ignored", msg.replica, peer)
        elif isinstance(msg, P.Hello):
            rep = None
            if msg.worker.encode() == peer and r.state in ("starting", "ready"):
                rep = r.replicas.on_hello(msg.worker, msg.replica, msg.rank, msg.pid, msg.host)
            if rep is None:
                log.warning("refusing worker %s (replica %d rank %d)", msg.worker, msg.replica, msg.rank)
                await r.workers_sock.send(peer, P.Shutdown())
                return
            s = r.serve_cfg
            await r.workers_sock.send(peer, P.Assign(rep.index, msg.rank, rep.tensor_parallel,
                                                        rep.index * rep.tensor_parallel + msg.rank,
                                                        r.engine_cfg.to_dict(), s.heartbeat_s, s.heartbeat_timeout_s,
                                                        rep.dist_init))
        elif isinstance(msg, P.Ready):
            if r.replicas.worker(peer.decode(errors="replace")) is None:
                await r.workers_sock.send(peer, P.Shutdown())   # e.g. its replica timed out while loading
                return
            rep = r.replicas.on_ready(peer.decode(errors="replace"), msg.info)
            if rep is not None:
                r.balancer.forget(rep.index)
                log.info("replica %d ready (%s)", rep.index, rep.workers[0].info.get("device"))
        elif isinstance(msg, P.LoadFailed):
            found = r.replicas.worker(peer.decode(errors="replace"))
            if found is not None:
                found[0].load_failed = msg.code in PERMANENT_LOAD_ERRORS
                r.startup_errors.append((msg.code, msg.message))
                await r.supervisor.replica_died(found[0], f"could not load the model: {msg.message}")
        elif isinstance(msg, P.ProtocolError):
            log.warning("bad frame from worker %r: %s", peer, msg)
        else:
            log.warning("unexpected %s from worker %r", type(msg).__name__, peer)

    @staticmethod
    def _from_replica(peer: bytes, live: Any) -> bool:
        return live.replica is not None and live.replica.leader == peer and live.replica.state == "ready"

    async def _on_step(self, peer: bytes, msg: P.StepTokens) -> None:
        r = self.router
        n = len(msg.req_ids)
        if not (len(msg.token_ids) == len(msg.finish_reasons) == len(msg.cached_tokens) == n) or (
                msg.logprobs is not None and len(msg.logprobs) != n) or (
                msg.prompt_logprobs is not None and len(msg.prompt_logprobs) != n):
            log.warning("malformed StepTokens from %r", peer)
            return
        # A client's deltas of this step go out as one frame (DeltaBatch) after the step's tokens are read,
        # one frame per BATCH_BYTES of token ids and text.
        batches: dict[bytes, tuple[list[P.Delta], list[int]]] = {}
        try:
            for i, rid in enumerate(msg.req_ids):
                live = r.live.get(rid)
                if live is None or live.state is None or not self._from_replica(peer, live):
                    continue                          # aborted, or a late token of a dead generation
                lp = msg.logprobs[i] if msg.logprobs is not None else None
                plp = msg.prompt_logprobs[i] if msg.prompt_logprobs is not None else None
                params = live.state.params
                if (lp is not None and (lp := _logprob_entry(lp, params.logprobs or 0, _vocab_size(live))) is None) or (
                        plp is not None and (params.prompt_logprobs is None or (plp := _prompt_logprobs(
                            plp, len(live.state.prompt_ids), params.prompt_logprobs, _vocab_size(live))) is None)):
                    log.warning("malformed logprobs from %r for request %d", peer, rid)
                    await r.end(live, Ended("error", "the replica sent malformed logprobs"), tell_replica=True)
                    continue
                ev = _TokenEvent(msg.token_ids[i], lp, msg.finish_reasons[i], msg.cached_tokens[i], plp)
                chunk = live.state.on_event(ev)
                packed, live.state.packed_prompt_logprobs = live.state.packed_prompt_logprobs, None
                if chunk is not None and packed is not None:
                    # up to MAX_PROMPT_LOGPROBS_BYTES: a frame of its own, after the client's deltas so far;
                    # the bytes go on as the worker packed them
                    if (queued := batches.pop(live.peer, None)) is not None:
                        await r.send_deltas(live.peer, queued[0])
                    d = r.delta(live, chunk)
                    d.prompt_logprobs = packed
                    await r.send_deltas(live.peer, [d])
                elif chunk is not None:
                    d = r.delta(live, chunk)
                    deltas, size = batches.setdefault(live.peer, ([], [0]))
                    deltas.append(d)
                    size[0] += _delta_bytes(d)
                    if size[0] >= BATCH_BYTES or len(deltas) >= P.MAX_BATCH_DELTAS:
                        del batches[live.peer]
                        await r.send_deltas(live.peer, deltas)
                if live.state.needs_abort:
                    live.state.needs_abort = False
                    await r.workers_sock.send(peer, P.AbortRequest(rid))
                if live.state.finished:
                    r.forget(live)
        finally:
            # Also when a request's event raised: the deltas made so far (final ones of forgotten requests
            # among them) still go out.
            for client, (deltas, _) in batches.items():
                await r.send_deltas(client, deltas)
