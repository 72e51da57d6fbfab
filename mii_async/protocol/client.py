"""The client ⇄ router hop: what a client (AsyncClient, the gateway) sends to the router and what comes back.

Ids here are the client's own strings; the router maps them to its request numbers (worker.py's int req_ids).
A client's Shutdown (worker.py) also travels this hop and is answered with a QueryReply.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..packed import PromptLogprobs
from .codec import IDS, PROMPT_LOGPROBS, list_of, message


@message
@dataclass(kw_only=True)
class Generate:
    """Client → router: start a request."""
    req_id: str                                    # chosen by the client, unique among its live requests; every
                                                   # Delta or ErrorReply for the request carries it
    prompt: str | None = None                      # text, or None when prompt_ids / messages are given
    prompt_ids: list[int] | None = field(default=None, metadata=IDS)   # token ids, used as they are
    messages: list[dict] | None = None             # chat messages, through the model's chat template
    params: dict = field(default_factory=dict)     # SamplingParams fields; validated by the router


@message
@dataclass(kw_only=True)
class Abort:
    """Client → router: end a request now (its KV blocks are freed within a step)."""
    req_id: str                                    # a live Generate's; an id that is not live is ignored


@message
@dataclass(kw_only=True)
class Delta:
    """Router → client: new text of one request; the last one has finish_reason and usage."""
    req_id: str                                    # the Generate's
    text: str                                      # UTF-8 safe, never a partial stop string
    token_ids: list[int] = field(default_factory=list, metadata=IDS)   # the ids sampled since the last Delta
    logprobs: list | None = None                   # per token: [token_id, logprob, [[id, logprob], …], rank]
                                                   # (natural log), when the request asked for logprobs
    finish_reason: str | None = None               # "stop" | "length" | "abort" | "error"
    usage: dict | None = None                      # prompt_tokens, completion_tokens, cached_tokens
    error: str | None = None                       # with finish_reason "error"
    prompt_ids: list[int] | None = field(default=None, metadata=IDS)   # first delta only: the prompt's ids
    prompt_logprobs: PromptLogprobs | None = field(default=None, metadata=PROMPT_LOGPROBS)   # when asked, on the
                                                   # delta of the first sampled token (which has prompt_ids):
                                                   # one position per prompt token after the first


@message
@dataclass(kw_only=True)
class DeltaBatch:
    """Router → client: the Deltas of one engine step for this client's requests, in one frame (one send and
    one receive per step instead of one per request)."""
    deltas: list[Delta] = field(metadata=list_of(Delta))   # each as a Delta's map, without "v" and "t";
                                                   # at most codec.MAX_BATCH_DELTAS


@message
@dataclass(kw_only=True)
class ErrorReply:
    """Router → client: a request refused before it started (bad parameter, overload, bad frame)."""
    req_id: str | None                             # the refused Generate's or Query's; None when the refusal
                                                   # names none (an unreadable frame, an id already live)
    code: str                                      # "invalid_parameter" | "overloaded" | "bad_frame" | … (the
                                                   # keys of errors.ERROR_CODES: the caller's exception class)
    message: str                                   # for people: what was wrong, naming the value
    param: str | None = None                       # the bad parameter, when there is one


@message
@dataclass(kw_only=True)
class Query:
    """Client → router: a question about the deployment, answered by a QueryReply with the same req_id."""
    req_id: str                                    # chosen by the client, unique among its pending queries
    what: str                                      # "ping" | "health" | "stats" | "reset_prefix_cache"


@message
@dataclass(kw_only=True)
class QueryReply:
    """Router → client."""
    req_id: str                                    # the Query's, or a client Shutdown's
    result: dict                                   # ping: {"live": the asker's live req_ids}; health: state and
                                                   # replicas; stats: per replica; Shutdown: {"state": "draining"}
