"""Every wire message between client, router and workers, and their one msgpack encoding.

A frame is a msgpack map {"v": PROTOCOL_VERSION, "t": <message name>, <fields>}. Token-id lists travel as
packed little-endian uint32 arrays (msgpack bin), not as lists of ints, and a prompt's logprobs as packed
arrays too (PromptLogprobs); a list of messages (DeltaBatch) as a list of such maps without "v" and "t". Never
pickle. `decode` checks the version, the type, that every field is present and of its declared type, and
msgpack's own length limits; anything else raises ProtocolError, which the receiver counts and answers
without stopping. Each message type's field checks are built once, at import: decoding runs on every token's
path (router, gateway, client).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

import msgpack

from .packed import PromptLogprobs, as_prompt_logprobs, pack_ids, unpack

PROTOCOL_VERSION = 7                  # 2: DeltaBatch, StatsQuery.reset_prefix_cache; 3: prompt_logprobs
                                      # (StepTokens, Delta): a peer of 2 refuses them as unknown fields;
                                      # 4: prompt_logprobs as packed arrays (PromptLogprobs), not nested lists;
                                      # 5: PromptLogprobs carry each prompt token's rank; 6: so do sampled
                                      # tokens' logprobs; 7: RequestFailed.param, ping lists live ids
MAX_FRAME_BYTES = 16 * 2**20          # also the sockets' ZMQ_MAXMSGSIZE
MAX_ITEMS = 1 << 20                    # longest msgpack array or map, and bin length in ids
MAX_BATCH_DELTAS = 1 << 14             # Deltas in one DeltaBatch at most (each is checked and built on decode)
MAX_PROMPT_LOGPROBS_BYTES = 4 * 2**20  # one request's prompt logprobs (with its prompt ids) in a frame at most,
                                       # by packed.prompt_logprobs_bytes: the router refuses a request that needs more.
                                       # Packed, that is 209k prompt tokens at n = 1, 24k at n = 20; what
                                       # bounds it is the client, which makes Logprob objects of them all at
                                       # once (~0.4 s on its loop for 209k at n = 1, 0.1 s for 24k at n = 20)

ENGINE_COUNTERS = ("num_blocks", "free_blocks", "used_blocks", "cached_blocks", "prefix_hit_tokens",
                   "prefix_query_tokens", "running", "waiting", "preemptions", "steps")
                                       # every engine's StatsReport carries these; the router's stats() sums
                                       # them, each key present (0 when no replica answered)

_IDS = {"ids": True}                   # field metadata: a packed token-id array on the wire
_PLPS = {"plps": "one"}                # a PromptLogprobs ([n, own, top_ids, top_logprobs, ranks] on the wire)
_EACH_PLPS = {"plps": "each"}          # a list of PromptLogprobs or None


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""
    req_id: str | None = None          # a refused Generate's or Query's id, when the frame shows it: the reply's


class FrameTooLarge(ProtocolError):
    """A message over MAX_FRAME_BYTES, refused by `encode`: the peer would drop the whole connection."""


# -- client ⇄ router ---------------------------------------------------------------------------------
@dataclass
class Generate:
    """Client → router: start a request."""
    req_id: str                                    # chosen by the client, unique among its live requests
    prompt: str | None = None                      # text, or None when prompt_ids / messages are given
    prompt_ids: list[int] | None = field(default=None, metadata=_IDS)
    messages: list[dict] | None = None             # chat messages, through the model's chat template
    params: dict = field(default_factory=dict)     # SamplingParams fields; validated by the router


@dataclass
class Abort:
    """Client → router: end a request now (its KV blocks are freed within a step)."""
    req_id: str


@dataclass
class Delta:
    """Router → client: new text of one request; the last one has finish_reason and usage."""
    req_id: str
    text: str                                      # UTF-8 safe, never a partial stop string
    token_ids: list[int] = field(default_factory=list, metadata=_IDS)
    logprobs: list | None = None                   # per token: [token_id, logprob, [[id, logprob], …], rank]
    finish_reason: str | None = None               # "stop" | "length" | "abort" | "error"
    usage: dict | None = None                      # prompt_tokens, completion_tokens, cached_tokens
    error: str | None = None                       # with finish_reason "error"
    prompt_ids: list[int] | None = field(default=None, metadata=_IDS)   # first delta only: the prompt's ids
    prompt_logprobs: PromptLogprobs | None = field(default=None, metadata=_PLPS)   # when asked, on the delta
                                                   # of the first sampled token (which has prompt_ids): one
                                                   # position per prompt token after the first


@dataclass
class DeltaBatch:
    """Router → client: the Deltas of one engine step for this client's requests, in one frame (one send and
    one receive per step instead of one per request)."""
    deltas: list[Delta] = field(metadata={"of": Delta})    # each as a Delta's map, without "v" and "t"


@dataclass
class ErrorReply:
    """Router → client: a request refused before it started (bad parameter, overload, bad frame)."""
    req_id: str | None
    code: str                                      # "invalid_parameter" | "overloaded" | "bad_frame" | …
    message: str
    param: str | None = None                       # the bad parameter, when there is one


@dataclass
class Query:
    """Client → router: a question about the deployment, answered by a QueryReply with the same req_id."""
    req_id: str
    what: str                                      # "ping" | "health" | "stats" | "reset_prefix_cache"


@dataclass
class QueryReply:
    """Router → client."""
    req_id: str
    result: dict                                   # ping: {"live": the asker's live req_ids}; health: state and replicas; stats: per replica


# -- router ⇄ worker ---------------------------------------------------------------------------------
@dataclass
class Hello:
    """Worker → router, its first message; the router answers with Assign."""
    worker: str                                    # unique name ("host:pid:nonce"); also its routing id
    replica: int                                   # the replica it was started for; -1: joining, assign one
    rank: int                                      # its rank in the replica's tensor-parallel group
    pid: int
    host: str


@dataclass
class Assign:
    """Router → worker: what to serve."""
    replica: int
    rank: int
    tensor_parallel: int
    device_index: int                              # which local accelerator, when there are several
    config: dict                                   # EngineConfig.to_dict()
    heartbeat_s: float                             # the worker's heartbeat period
    heartbeat_timeout_s: float                     # the router is gone when it has not answered this long
    dist_init: str = ""                            # torch.distributed rendezvous of the replica's TP group


@dataclass
class LoadFailed:
    """Worker → router: the model could not be loaded; the worker exits after sending this."""
    replica: int
    code: str                                      # errors.ERROR_CODES key
    message: str


@dataclass
class StatsQuery:
    """Router → replica leader: report the engine's counters now (after every earlier message)."""
    token: int
    reset_prefix_cache: bool = False               # first forget the prefixes of the blocks no request holds


@dataclass
class StatsReport:
    """Replica leader → router."""
    token: int
    replica: int
    stats: dict


@dataclass
class AddRequest:
    """Router → replica leader."""
    req_id: int                                    # router-wide request number
    prompt_ids: list[int] = field(metadata=_IDS)
    params: dict = field(default_factory=dict)     # already validated SamplingParams fields


@dataclass
class AbortRequest:
    """Router → replica leader."""
    req_id: int


@dataclass
class StepTokens:
    """Replica leader → router: every token one engine step sampled."""
    req_ids: list[int]
    token_ids: list[int] = field(metadata=_IDS)    # parallel to req_ids
    finish_reasons: list[str | None] = field(default_factory=list)   # parallel; None while running
    cached_tokens: list[int] = field(default_factory=list)           # parallel; prefix-cache hits
    logprobs: list | None = None                   # parallel, entries None or [logprob, [[id, lp], …], rank]
    prompt_logprobs: list | None = field(default=None, metadata=_EACH_PLPS)  # parallel, entries None or, on a
                                                   # request's first sampled token when it asked, its prompt's
                                                   # PromptLogprobs; None when none is set. An entry that is
                                                   # not [int, bin, bin, bin] decodes as it came: the router
                                                   # fails that request only


@dataclass
class Ready:
    """Worker → router: loaded and serving (the ready handshake)."""
    replica: int
    rank: int
    info: dict = field(default_factory=dict)       # num_blocks, block_size, max_model_len, vocab_size, …


@dataclass
class Heartbeat:
    """Worker → router every `heartbeat_s` on its own socket, with the engine's counters; the router echoes
    it back (replica -1) so that a worker notices a router that is gone."""
    replica: int
    stats: dict = field(default_factory=dict)


@dataclass
class RequestFailed:
    """Replica leader → router: a request ended with an error inside the engine. `param`: the request's value
    at fault, when it can never work (a guide outlines-core refuses): the router refuses the request, naming
    it, if it has streamed nothing yet."""
    req_id: int
    message: str
    param: str | None = None


@dataclass
class Shutdown:
    """Router → worker, or client → router: stop (drain up to `drain_s`, then abort). The router answers a
    client's Shutdown with a QueryReply for `req_id` before it starts draining."""
    drain_s: float = 0.0
    req_id: str | None = None


Message = Union[Generate, Abort, Delta, DeltaBatch, ErrorReply, Query, QueryReply, Hello, Assign, LoadFailed,
                StatsQuery, StatsReport, AddRequest, AbortRequest, StepTokens, Ready, Heartbeat, RequestFailed,
                Shutdown]
_TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}


def _unpack_ids(b: Any, name: str) -> list[int]:
    if not isinstance(b, bytes) or len(b) % 4:
        raise ProtocolError(f"field {name!r} must be a packed uint32 array")
    return unpack(b, "I")


def _unpack_prompt_logprobs(x: Any, name: str) -> PromptLogprobs:
    if type(p := as_prompt_logprobs(x)) is not PromptLogprobs:
        raise ProtocolError(f"field {name!r} must be [n, own, top_ids, top_logprobs, ranks] of packed arrays")
    return p


def _unpack_each_prompt_logprobs(x: Any, name: str) -> list:
    if type(x) is not list:
        raise ProtocolError(f"field {name!r} must be a list")
    return [None if e is None else as_prompt_logprobs(e) for e in x]


def encode(msg: Message) -> bytes:
    frame: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": type(msg).__name__}
    _put_fields(msg, frame)
    data = msgpack.packb(frame, use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"a {type(msg).__name__} of {len(data)} bytes exceeds the {MAX_FRAME_BYTES >> 20} MiB of a frame")
    return data


def _put_fields(msg: Any, frame: dict[str, Any]) -> dict[str, Any]:
    for f in _SPECS[type(msg).__name__]:
        value = getattr(msg, f.name)
        if value is not None and f.ids:
            value = pack_ids(value)
        elif value is not None and f.of is not None:
            value = [_put_fields(m, {}) for m in value]
        frame[f.name] = value
    return frame


def decode(data: bytes) -> Message:
    """Parses one frame; raises ProtocolError for anything else (with a Generate's or Query's req_id)."""
    try:
        return _decode(data)
    except ProtocolError as exc:
        exc.req_id = _req_id_of(data)
        raise


def _req_id_of(data: bytes) -> str | None:
    """The req_id of a refused Generate or Query frame, read leniently (not an Abort's: a reply under its id
    would end the live request it names)."""
    try:
        frame = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=MAX_FRAME_BYTES, max_ext_len=0,
                                max_str_len=MAX_FRAME_BYTES, max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS)
    except Exception:  # noqa: BLE001 - not msgpack at all: no id to answer under
        return None
    ok = isinstance(frame, dict) and frame.get("t") in ("Generate", "Query") and isinstance(frame.get("req_id"), str)
    return frame["req_id"] if ok and len(frame["req_id"]) <= 256 else None


def _decode(data: bytes) -> Message:
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        frame = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_FRAME_BYTES,
                                max_str_len=MAX_FRAME_BYTES, max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS,
                                max_ext_len=0)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad input
        raise ProtocolError(f"not a msgpack frame: {exc}") from None
    if not isinstance(frame, dict):
        raise ProtocolError("a frame must be a msgpack map")
    if frame.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {frame.get('v')!r} is not {PROTOCOL_VERSION}")
    name = frame.pop("t", None)
    del frame["v"]
    if not isinstance(name, str) or name not in _TYPES:
        raise ProtocolError(f"unknown message type {name!r}")
    return _from_fields(name, frame)


def _from_fields(name: str, frame: dict[str, Any]) -> Any:
    """The message `name` from its fields' map (without "v" and "t"), each checked against its declaration."""
    kwargs: dict[str, Any] = {}
    for f in _SPECS[name]:
        if f.name not in frame:
            if f.required:
                raise ProtocolError(f"{name}: missing field {f.name!r}")
            continue
        value = frame[f.name]
        if value is not None and f.unpack is not None:
            value = f.unpack(value, f.name)
        elif not f.check(value):
            raise ProtocolError(f"{name}.{f.name}: {type(value).__name__} does not match {f.hint}")
        elif value is not None and f.of is not None:
            if len(value) > MAX_BATCH_DELTAS:
                raise ProtocolError(f"{name}.{f.name}: {len(value)} entries exceed {MAX_BATCH_DELTAS}")
            value = [_from_fields(f.of, m) if isinstance(m, dict) else _not_a_map(name, f.name) for m in value]
        kwargs[f.name] = value
    if len(kwargs) < len(frame):
        extra = set(frame) - set(kwargs)
        raise ProtocolError(f"{name}: unknown fields {sorted(extra, key=repr)}")
    if name == "Delta" and kwargs.get("prompt_logprobs") is not None:
        ids = kwargs.get("prompt_ids")
        if ids is None or len(ids) != kwargs["prompt_logprobs"].num_positions + 1:
            raise ProtocolError("Delta: prompt_logprobs need the prompt's ids, one position per token after the first")
    return _TYPES[name](**kwargs)


def _not_a_map(name: str, field_name: str) -> Any:
    raise ProtocolError(f"{name}.{field_name}: every entry must be a map of fields")


class _FieldSpec(NamedTuple):
    name: str
    hint: Any                          # the declared type, for error messages
    check: Callable[[Any], bool]       # the value conforms (outer type; list elements of lists of scalars too)
    required: bool                     # no default
    ids: bool                          # a packed token-id array on the wire
    of: str | None                     # a list of this message type, each as a map of its fields
    unpack: Callable[[Any, str], Any] | None   # turns a packed wire value (not None) into the field's value


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A shallow type check for `hint`, built once: the outer type of a value, and the elements of a list."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        parts = [h for h in typing.get_args(hint) if h is not type(None)]
        nullable = len(parts) < len(typing.get_args(hint))
        checks = [_checker(h) for h in parts]
        if nullable and len(checks) == 1:
            (one,) = checks
            return lambda v: v is None or one(v)
        return lambda v: (nullable and v is None) or any(c(v) for c in checks)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if origin is list:
        args = typing.get_args(hint)
        if not args or dataclasses.is_dataclass(args[0]):
            return lambda v: isinstance(v, list)       # messages: checked one by one as they are built
        each = _checker(args[0])
        return lambda v: isinstance(v, list) and all(map(each, v))
    if origin is dict or hint is dict:
        return lambda v: isinstance(v, dict)
    if hint is list:
        return lambda v: isinstance(v, list)
    return lambda v: isinstance(v, hint)


_UNPACK = {"one": _unpack_prompt_logprobs, "each": _unpack_each_prompt_logprobs}


def _spec(cls: type) -> list[_FieldSpec]:
    hints = typing.get_type_hints(cls)
    return [_FieldSpec(f.name, hints[f.name], _checker(hints[f.name]),
                       f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                       bool(f.metadata.get("ids")), f.metadata["of"].__name__ if "of" in f.metadata else None,
                       _unpack_ids if f.metadata.get("ids") else _UNPACK.get(f.metadata.get("plps")))
            for f in dataclasses.fields(cls)]


_SPECS: dict[str, list[_FieldSpec]] = {name: _spec(cls) for name, cls in _TYPES.items()}
