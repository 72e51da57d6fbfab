"""RouterCore: the router without sockets — events in, sends out.

Events: from a client, a Generate, an Abort or a bad frame; from the encoder, a prompt's ids (or its failure);
from a replica, its step tokens, a request it failed, its readiness or its death; from the clock, the clients
that went silent. Each event updates the request table (requests.py) and appends what must leave to `sends`:
Deltas and ErrorReplies for clients (ToClient), AddRequest and AbortRequest for replica leaders (ToReplica).
The shells — the clients' loop (server.py), the workers' loop (worker_link.py) and the health loop
(supervisor.py) — feed it and write `sends` out, in order, after each event; nothing here awaits, so one event
is handled whole before the next.

Encoding a prompt takes milliseconds to seconds: `generate` answers with the prompt to encode (Encode: a chat
with the tools it shows, and the request's RenderOptions, through text/prompts.py — the one place where
prompts become ids), the shell encodes it off the loop and feeds the ids back to `encoded`, which admits the
request (admission.py), picks a replica (balancer.py) and sends it the ids; a background request (priority
above 0) is held instead, and sent when a replica has spare capacity for it (background_queue.py: after each
event that can free some). An abort meanwhile ends the request at once; the late ids then find it gone.
Each StepTokens from a replica leader is detokenized per request (UTF-8 safe, stop strings) and streamed to the
clients as Deltas, one frame per client per step (deltas.py); a stop string ends a request here, and the
replica is told to abort it. Tokens of aborted requests and late ones of a dead generation are dropped. A bad
request gets an ErrorReply and the next event is handled as usual.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, NamedTuple, Union

from .. import protocol as P
from ..errors import InvalidParameterError, MIIAsyncError, UnavailableError, error_code
from ..outputs import FinishReason
from ..params import MAX_TOKEN_ID
from ..text.chat_tools import keeping_markers
from ..text.render_options import RenderOptions
from ..text.request_state import Ended, RequestState
from .admission import Admission, Prompt
from .background_queue import BackgroundQueue, is_background
from .balancer import Balancer, Candidate
from .deltas import StepFrames, to_delta
from .replicas import Replica, ReplicaSet
from .requests import LiveRequest, RequestTable
from .token_events import token_event

log = logging.getLogger("mii_async.router")


class ToClient(NamedTuple):
    peer: bytes                # the client's routing id on the clients' socket
    msg: P.Message


class ToReplica(NamedTuple):
    peer: bytes                # a worker's routing id (a replica's leader for requests) on the workers' socket
    msg: P.Message


Send = Union[ToClient, ToReplica]


class Encode(NamedTuple):      # a prompt to turn into ids off the loop; the answer goes to `encoded`
    rid: int
    prompt: Prompt
    tools: list[dict] | None   # a chat's tools, rendered with it (text/chat_tools.py)
    parallel_tool_calls: bool  # with tools: the prompt allows several calls per answer
    fit_context: bool          # `encoded` lowers max_new_tokens to the room the prompt leaves
    options: RenderOptions     # how the prompt is rendered and tokenized (the Generate's fields, checked)


class RouterCore:
    def __init__(self, replicas: ReplicaSet, balancer: Balancer, admission: Admission,
                 tokenizer: Any = None, background: BackgroundQueue | None = None) -> None:
        self.replicas = replicas
        self.balancer = balancer
        self.admission = admission
        # background requests (priority > 0) wait here for spare capacity (background_queue.py)
        self.background = background if background is not None else BackgroundQueue()
        self.tokenizer = tokenizer        # decodes every stream; the shell sets it once loaded, before any Generate
        self.requests = RequestTable()
        self.client_seen: dict[bytes, float] = {}   # client → when it was last heard (monotonic seconds)
        self.state = "starting"           # starting | ready | draining | stopped: set by the shell
        self.counters = {"requests": 0, "rejected": 0, "overloaded": 0, "failed": 0, "replica_deaths": 0,
                         "refused_control": 0,        # Shutdown, stats or reset from a key that is not the operator's
                         "bad_worker_messages": 0}    # malformed messages from workers (each failed its replica)
        self.sends: deque[Send] = deque()  # what must leave, oldest first; the shells write and pop them

    # -- clients -------------------------------------------------------------------------------------
    def heard_from(self, peer: bytes, now: float) -> None:
        self.client_seen[peer] = now

    def client_message(self, peer: bytes, msg: Any) -> Encode | None:
        """A client's Generate (the prompt to encode, when admitted so far), Abort or bad frame. Queries and
        Shutdown are the shell's: they wait on replicas or stop the process."""
        if isinstance(msg, P.Generate):
            return self.generate(peer, msg)
        if isinstance(msg, P.Abort):
            self.abort(peer, msg.req_id)
        elif isinstance(msg, P.ProtocolError):       # under the refused Generate's id: its stream ends now
            self._to_client(peer, P.ErrorReply(req_id=msg.req_id, code="bad_frame", message=str(msg)))
        else:
            self._to_client(peer, P.ErrorReply(req_id=None, code="bad_frame",
                                               message=f"a client may not send {type(msg).__name__}"))
        return None

    def generate(self, peer: bytes, msg: P.Generate) -> Encode | None:
        """Checks a Generate on arrival; an admitted one is live from now, its prompt to be encoded."""
        self.counters["requests"] += 1
        if self.requests.find(peer, msg.req_id) is not None:
            # not under that id, whose live stream the reply would end (AsyncClient never reuses an id)
            self._refuse(peer, None, InvalidParameterError("req_id", f"{msg.req_id!r} is already live"))
            return None
        try:
            arrival = self.admission.on_arrival(msg, self.state, len(self.requests), self.replicas.limits())
            options = RenderOptions.of(msg)
        except Exception as exc:  # noqa: BLE001 - a bad request is refused, never stops the loop
            self._refuse(peer, msg.req_id, _as_refusal(exc, msg.req_id))
            return None
        params = keeping_markers(arrival.params, self.tokenizer) if msg.keep_tool_markers else arrival.params
        live = self.requests.open(peer, msg.req_id, params)
        self.background.arrived(live.rid, params)
        return Encode(live.rid, arrival.prompt, msg.tools, msg.parallel_tool_calls, msg.fit_context, options)

    def encoded(self, rid: int, text: str | None, ids: list[int], *, fit_context: bool = False) -> None:
        """A prompt's ids: the request is admitted against the replicas' limits and the queued tokens, and
        goes to a replica; or refused. `fit_context`: the Encode's (max_new_tokens fitted to the room left)."""
        live = self.requests.get(rid)
        if live is None:
            return                                    # aborted while encoding
        self.background.encoded(rid)
        try:
            live.params, cost = self.admission.on_encoded(ids, live.params, self.replicas.limits(),
                                                          self.requests.queued_tokens, fit_context)
            if not self.replicas.ready():
                raise UnavailableError("no replica is ready")
            state = RequestState(self.tokenizer, text, ids, live.params)    # streams only: keeps no logprobs
        except Exception as exc:  # noqa: BLE001 - refused, as at arrival
            self.encode_failed(rid, exc)
            return
        if is_background(live.params):
            live.state = state                        # held: an abort now ends its stream as a dispatched one's
            self.background.hold(rid, live.params.priority, ids, cost)
        else:
            index = self.balancer.pick([Candidate(r.index, self.requests.load(r)) for r in self.replicas.ready()], ids)
            assert index is not None, "a ready replica was not picked"
            self._dispatch(live, state, self.replicas.replicas[index], ids, cost)
        self._admit_background()

    def _dispatch(self, live: LiveRequest, state: RequestState, rep: Replica, ids: list[int], cost: int) -> None:
        self.requests.dispatch(live, state, rep, cost)
        self.background.sent(live.rid, live.params, rep.index)
        self._to_replica(rep.leader, P.AddRequest(req_id=live.rid, prompt_ids=ids, params=live.params.to_wire()))

    def _admit_background(self) -> None:
        """Sends held background requests, in (priority, arrival) order, to the replicas with room for them."""
        while (taken := self.background.take(self.replicas.ready(), self.requests.queued_tokens,
                                             self.admission.max_queued_tokens)) is not None:
            held, room = taken
            live = self.requests.get(held.rid)
            assert live is not None and live.state is not None, f"held request {held.rid} is not live"
            index = self.balancer.pick([Candidate(r.index, self.requests.load(r)) for r in room], held.ids)
            assert index is not None, "a replica with room was not picked"
            self._dispatch(live, live.state, self.replicas.replicas[index], held.ids, held.cost)

    def _forget(self, live: LiveRequest) -> None:
        if self.requests.forget(live):
            self.background.forget(live.rid)

    def encode_failed(self, rid: int, exc: BaseException) -> None:
        """The prompt could not be encoded (or admitted): the request is refused."""
        live = self.requests.get(rid)
        if live is None:
            return                                    # aborted meanwhile
        self._forget(live)
        self._refuse(live.peer, live.creq, _as_refusal(exc, live.creq))
        self._admit_background()

    def abort(self, peer: bytes, creq: str) -> None:
        live = self.requests.find(peer, creq)
        if live is not None:
            self.end(live, Ended("abort"), tell_replica=True)
            self._admit_background()

    def expire_clients(self, now: float, timeout_s: float) -> None:
        """A client silent for `timeout_s` (it pings while it has requests) loses its requests, so that a
        crashed client does not hold KV blocks."""
        gone = {p for p, seen in self.client_seen.items() if now - seen > timeout_s}
        if not gone:
            return
        for live in self.requests:
            if live.peer in gone:
                log.warning("client %r silent for %.0f s: aborting its request %s", live.peer, timeout_s, live.creq)
                self.end(live, Ended("abort", "client timed out"), tell_replica=True)
        for p in gone:
            del self.client_seen[p]
        self._admit_background()

    def abort_all(self, reason: str) -> None:
        """Ends every live request with finish_reason "abort" and `reason` (the deployment is stopping)."""
        for live in self.requests:
            self.end(live, Ended("abort", reason), tell_replica=True)

    # -- replicas ------------------------------------------------------------------------------------
    def step_tokens(self, peer: bytes, msg: P.StepTokens) -> None:
        """One engine step's tokens from a replica leader (lists of one length: the worker link checks) — each
        request's chunk streams to its client."""
        frames = StepFrames(self._to_client)
        try:
            for i, rid in enumerate(msg.req_ids):
                live = self.requests.get(rid)
                if live is None or live.state is None or not _from_replica(peer, live):
                    continue                          # aborted, or a late token of a dead generation
                state = live.state
                ev = token_event(msg, i, state.params, len(state.prompt_ids), _vocab_size(live.replica))
                if ev is None:
                    log.warning("malformed logprobs from %r for request %d", peer, rid)
                    self.end(live, Ended("error", "the replica sent malformed logprobs"), tell_replica=True)
                    continue
                chunk = state.on_event(ev)
                packed, state.packed_prompt_logprobs = state.packed_prompt_logprobs, None
                if chunk is not None:
                    d = to_delta(live.creq, chunk, packed)
                    if packed is not None:          # up to MAX_PROMPT_LOGPROBS_BYTES: the worker's bytes as they came
                        frames.alone(live.peer, d)
                    else:
                        frames.add(live.peer, d)
                if state.needs_abort:
                    state.needs_abort = False
                    self._to_replica(peer, P.AbortRequest(req_id=rid))
                if state.finished:
                    self._forget(live)
        finally:
            # Also when a request's event raised: the deltas made so far (final ones of forgotten requests
            # among them) still go out.
            frames.close()
            self._admit_background()

    def request_failed(self, peer: bytes, msg: P.RequestFailed) -> None:
        """A replica leader ended a request with an error; with `param`, the request's value is at fault."""
        live = self.requests.get(msg.req_id)
        if live is not None and _from_replica(peer, live):
            self.counters["failed" if msg.param is None else "rejected"] += 1   # a caller's value: refused
            self.end(live, Ended("error", msg.message, msg.param), tell_replica=False)
            self._admit_background()

    def replica_ready(self, rep: Replica) -> None:
        """A replica (a new generation of its number) serves: its prefix cache is empty."""
        self.balancer.forget(rep.index)
        self._admit_background()

    def fail_replica(self, rep: Replica, reason: str) -> None:
        """A replica died: each of its in-flight requests ends with finish_reason "error" and a message that
        names the replica and `reason`."""
        self.counters["replica_deaths"] += 1
        log.error("replica %d died: %s; failing its %d request(s)", rep.index, reason, len(rep.requests))
        for rid in list(rep.requests):
            live = self.requests.get(rid)
            if live is not None:
                self.counters["failed"] += 1
                self.end(live, Ended("error", f"replica {rep.index} failed: {reason}"), tell_replica=False)
        if not self.replicas.ready():                 # refused as a request encoded now would be
            for held in self.background.held():
                if (live := self.requests.get(held.rid)) is not None:
                    self._forget(live)
                    self._refuse(live.peer, live.creq, UnavailableError("no replica is ready"))
        self._admit_background()

    # -- ending --------------------------------------------------------------------------------------
    def end(self, live: LiveRequest, ev: Ended, tell_replica: bool) -> None:
        """Ends a live request with an abort or an error, telling the client (and, with `tell_replica`, the
        replica, while it is ready)."""
        self._forget(live)
        if live.state is None:                      # still encoding: `encoded` will find it gone
            if ev.reason == "error":
                code = "generation_failed" if ev.param is None else "invalid_parameter"
                self._to_client(live.peer, P.ErrorReply(req_id=live.creq, code=code, message=ev.error or "error",
                                                        param=ev.param))
            else:
                self._to_client(live.peer, P.Delta(req_id=live.creq, text="", token_ids=[],
                                                   finish_reason=FinishReason.ABORT, error=ev.error))
            return
        if tell_replica and live.replica is not None and live.replica.state == "ready":
            self._to_replica(live.replica.leader, P.AbortRequest(req_id=live.rid))
        chunk = live.state.on_event(ev)
        if (refusal := live.state.refusal) is not None:   # nothing streamed yet: refused, as at submission
            self._to_client(live.peer, P.ErrorReply(req_id=live.creq, code="invalid_parameter", message=str(refusal),
                                                    param=refusal.param))
        elif chunk is not None:
            self._to_client(live.peer, to_delta(live.creq, chunk))

    def _refuse(self, peer: bytes, creq: str | None, exc: MIIAsyncError) -> None:
        code = error_code(exc)
        self.counters["overloaded" if code == "overloaded" else "rejected"] += 1
        self._to_client(peer, P.ErrorReply(req_id=creq, code=code, message=str(exc), param=getattr(exc, "param", None)))

    def _to_client(self, peer: bytes, msg: P.Message) -> None:
        self.sends.append(ToClient(peer, msg))

    def _to_replica(self, peer: bytes | None, msg: P.Message) -> None:
        assert peer is not None, "a message for a replica without a leader"
        self.sends.append(ToReplica(peer, msg))


def _from_replica(peer: bytes, live: LiveRequest) -> bool:
    """`peer` is the leader of the ready replica that serves `live` (not a dead generation's)."""
    return live.replica is not None and live.replica.leader == peer and live.replica.state == "ready"


def _vocab_size(rep: Replica) -> int:
    """The vocabulary of a ready replica (its leader reported it in Ready)."""
    return rep.workers[0].info.get("vocab_size", MAX_TOKEN_ID + 1)


def _as_refusal(exc: BaseException, creq: str | None) -> MIIAsyncError:
    """The error a refused request is answered with: ours as it is; anything else (a tokenizer's error on odd
    input) as an invalid prompt."""
    if isinstance(exc, MIIAsyncError):
        return exc
    log.error("request %s failed before dispatch", creq, exc_info=exc)
    return InvalidParameterError("prompt", f"could not be encoded: {exc}")
