"""The router ⇄ worker hop: a worker's handshake, the requests the router hands a replica's leader (rank 0),
the tokens each engine step sampled, heartbeats and stopping.

Request ids here are the router's own numbers (ints, unique router-wide), never a client's strings. Shutdown
also travels client → router (client.py's hop).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..outputs import FinishReason
from .codec import EACH_PROMPT_LOGPROBS, IDS, message

ENGINE_COUNTERS = ("num_blocks", "free_blocks", "used_blocks", "cached_blocks", "prefix_hit_tokens",
                   "prefix_query_tokens", "running", "waiting", "preemptions", "steps")
                                       # every engine's StatsReport carries these; the router's stats() sums
                                       # them, each key present (0 when no replica answered)


@message
@dataclass(kw_only=True)
class Hello:
    """Worker → router, its first message; the router answers with Assign."""
    worker: str                                    # unique name ("host:pid:nonce"); also its routing id
    replica: int                                   # the replica it was started for; -1: joining, assign one
    rank: int                                      # its rank in the replica's tensor-parallel group
    pid: int                                       # its process id, for the router's health and logs
    host: str                                      # its machine's host name, for the same


@message
@dataclass(kw_only=True)
class Assign:
    """Router → worker: what to serve."""
    replica: int                                   # the replica it serves in from now on
    rank: int                                      # its rank in that replica's group, as in its Hello
    tensor_parallel: int                           # the number of ranks in the group
    device_index: int                              # which local accelerator, when there are several
    config: dict                                   # EngineConfig.to_dict()
    heartbeat_s: float                             # the worker's heartbeat period
    heartbeat_timeout_s: float                     # the router is gone when it has not answered this long
    dist_init: str = ""                            # torch.distributed rendezvous of the replica's TP group


@message
@dataclass(kw_only=True)
class LoadFailed:
    """Worker → router: the model could not be loaded; the worker exits after sending this."""
    replica: int                                   # the replica it was assigned
    code: str                                      # errors.ERROR_CODES key
    message: str                                   # the exception's type and text, for the router's startup errors


@message
@dataclass(kw_only=True)
class StatsQuery:
    """Router → replica leader: report the engine's counters now (after every earlier message)."""
    token: int                                     # chosen by the router per query; the StatsReport echoes it
    reset_prefix_cache: bool = False               # first forget the prefixes of the blocks no request holds


@message
@dataclass(kw_only=True)
class StatsReport:
    """Replica leader → router."""
    token: int                                     # the StatsQuery's
    replica: int                                   # the leader's replica
    stats: dict                                    # ENGINE_COUNTERS as of now; with a reset, also
                                                   # prefix_blocks_forgotten


@message
@dataclass(kw_only=True)
class AddRequest:
    """Router → replica leader."""
    req_id: int                                    # router-wide request number
    prompt_ids: list[int] = field(metadata=IDS)    # the whole prompt, tokenized by the router
    params: dict                                   # SamplingParams.to_wire(), checked by the router: the
                                                   # worker takes them as they are (from_wire, trusted)


@message
@dataclass(kw_only=True)
class AbortRequest:
    """Router → replica leader."""
    req_id: int                                    # an AddRequest's; the engine frees its blocks


@message
@dataclass(kw_only=True)
class StepTokens:
    """Replica leader → router: every token one engine step sampled."""
    req_ids: list[int]                             # the requests (AddRequest req_ids) that sampled a token
    token_ids: list[int] = field(metadata=IDS)     # parallel to req_ids
    finish_reasons: list[FinishReason | None] = field(default_factory=list)   # parallel; None while running
    cached_tokens: list[int] = field(default_factory=list)           # parallel; prefix-cache hits
    logprobs: list | None = None                   # parallel, entries None or Logprob.to_wire() ([logprob,
                                                   # [[id, lp], …], rank]) of the token_ids entry
    prompt_logprobs: list | None = field(default=None, metadata=EACH_PROMPT_LOGPROBS)  # parallel, entries None
                                                   # or, on a request's first sampled token when it asked, its
                                                   # prompt's PromptLogprobs; None when none is set. An entry
                                                   # that is not [int, bin, bin, bin] decodes as it came: the
                                                   # router fails that request only


@message
@dataclass(kw_only=True)
class Ready:
    """Worker → router: loaded and serving (the ready handshake)."""
    replica: int                                   # as assigned
    rank: int                                      # as assigned
    info: dict = field(default_factory=dict)       # num_blocks, block_size, max_model_len, vocab_size, …


@message
@dataclass(kw_only=True)
class Heartbeat:
    """Worker → router every `heartbeat_s` on its own socket, with the engine's counters; the router echoes
    it back (replica -1) so that a worker notices a router that is gone."""
    replica: int                                   # the worker's replica; -1 on the router's echo
    stats: dict = field(default_factory=dict)      # ENGINE_COUNTERS as of the leader's last refresh; {} on the echo


@message
@dataclass(kw_only=True)
class RequestFailed:
    """Replica leader → router: a request ended with an error inside the engine. `param`: the request's value
    at fault, when it can never work (a guide outlines-core refuses): the router refuses the request, naming
    it, if it has streamed nothing yet."""
    req_id: int                                    # an AddRequest's; the engine holds it no more
    message: str                                   # why, for the client's error
    param: str | None = None                       # the SamplingParams field at fault, or None


@message
@dataclass(kw_only=True)
class Shutdown:
    """Router → worker, or client → router: stop (drain up to `drain_s`, then abort). The router answers a
    client's Shutdown with a QueryReply for `req_id` before it starts draining."""
    drain_s: float = 0.0                           # seconds live requests may still finish in; a worker
                                                   # stops at once
    req_id: str | None = None                      # a client's: the acknowledging QueryReply's id; None from the router
