"""The one msgpack encoding of every wire message, its frame limits and its type checks.

A frame is a msgpack map {"v": PROTOCOL_VERSION, "t": <message name>, <fields>}. Token-id lists travel as
packed little-endian uint32 arrays (msgpack bin), not as lists of ints, and a prompt's logprobs as packed
arrays too (PromptLogprobs); a list of messages (DeltaBatch) as a list of such maps without "v" and "t"; a
finish reason as its string, decoded into the FinishReason (an unknown one is refused); the texts of tokens
(TokenTexts) as [packed ids, texts, bytes or None]. Never pickle. `decode` checks the version, the type, that
every field is present and of its declared type, and msgpack's own length limits; anything else raises
ProtocolError, which the receiver counts and answers without stopping. Each message type's field checks are
built once, when `message` registers it: decoding runs on every token's path (router, gateway, client).

The codec does not tell the hops apart: any registered message decodes on any socket, and each receiver
dispatches on the type and answers or logs one it does not expect.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, Union

import msgpack

from ..outputs import FinishReason, TokenTexts
from ..packed import PromptLogprobs, as_prompt_logprobs, pack_ids, unpack

if TYPE_CHECKING:
    from . import Message

PROTOCOL_VERSION = 10                 # any change to a message's fields or to their wire form takes a new number:
                                      # decode refuses a frame of another version, naming both, so that peers
                                      # of different builds fail loudly instead of misreading each other
MAX_FRAME_BYTES = 16 * 2**20          # also the sockets' ZMQ_MAXMSGSIZE
MAX_ITEMS = 1 << 20                    # longest msgpack array or map, and bin length in ids
MAX_BATCH_DELTAS = 1 << 14             # Deltas in one DeltaBatch at most (each is checked and built on decode)
MAX_PROMPT_LOGPROBS_BYTES = 4 * 2**20  # one request's prompt logprobs (with its prompt ids) in a frame at most,
                                       # by packed.prompt_logprobs_bytes: the router refuses a request that needs more.
                                       # Packed, that is 209k prompt tokens at n = 1, 24k at n = 20; what
                                       # bounds it is the client, which makes Logprob objects of them all at
                                       # once (~0.4 s on its loop for 209k at n = 1, 0.1 s for 24k at n = 20)

# Field metadata that changes a field's wire form (dataclasses.field(metadata=...)):
IDS = {"ids": True}                    # a list of token ids, as a packed uint32 array
PROMPT_LOGPROBS = {"plps": "one"}      # a PromptLogprobs ([n, own, top_ids, top_logprobs, ranks] on the wire)
EACH_PROMPT_LOGPROBS = {"plps": "each"}  # a list of PromptLogprobs or None
TOKEN_TEXTS = {"texts": True}          # a TokenTexts: [ids (packed uint32), their texts, their bytes where
                                       # not the text's UTF-8 (None entries elsewhere), or None when none is]


def list_of(cls: type) -> dict[str, type]:
    """Field metadata: a list of `cls` messages, each as the map of its fields (no "v" and "t")."""
    return {"of": cls}


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""
    req_id: str | None = None          # a refused Generate's or Query's id, when the frame shows it: the reply's


class FrameTooLarge(ProtocolError):
    """A message over MAX_FRAME_BYTES, refused by `encode`: the peer would drop the whole connection."""


class _FieldSpec(NamedTuple):
    name: str
    hint: Any                          # the declared type, for error messages
    check: Callable[[Any], bool]       # the value conforms (outer type; list elements of lists of scalars too)
    required: bool                     # no default
    of: str | None                     # a list of this message type, each as a map of its fields
    pack: Callable[[Any], Any] | None  # turns the field's value (not None) into its wire form
    unpack: Callable[[Any, str], Any] | None   # turns a wire value (not None) into the field's value, checked


_TYPES: dict[str, type] = {}           # every message type by its name, the frame's "t"
_SPECS: dict[str, list[_FieldSpec]] = {}   # its fields' checks, in declaration order

_M = TypeVar("_M", bound=type)


def message(cls: _M) -> _M:
    """Registers the dataclass `cls` as a wire message under its class name, building its field checks now.
    Its annotations must resolve in its module when it is decorated (a message it lists comes before it)."""
    assert dataclasses.is_dataclass(cls), f"{cls.__name__}: a wire message is a dataclass"
    assert cls.__name__ not in _TYPES, f"two wire messages named {cls.__name__}"
    _SPECS[cls.__name__] = _spec(cls)
    _TYPES[cls.__name__] = cls
    return cls


def encode(msg: Message) -> bytes:
    frame: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": type(msg).__name__}
    _put_fields(msg, frame)
    data = msgpack.packb(frame, use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"a {type(msg).__name__} of {len(data)} bytes exceeds the {MAX_FRAME_BYTES >> 20} MiB "
                            "of a frame")
    return data


def _put_fields(msg: Any, frame: dict[str, Any]) -> dict[str, Any]:
    for f in _SPECS[type(msg).__name__]:
        value = getattr(msg, f.name)
        if value is not None and f.pack is not None:
            value = f.pack(value)
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
    if name == "Delta":
        if kwargs.get("prompt_logprobs") is not None:
            ids = kwargs.get("prompt_ids")
            if ids is None or len(ids) != kwargs["prompt_logprobs"].num_positions + 1:
                raise ProtocolError("Delta: prompt_logprobs need the prompt's ids, one position per token after "
                                    "the first")
        if kwargs.get("logprobs") is not None and len(kwargs["logprobs"]) != len(kwargs.get("token_ids", ())):
            raise ProtocolError("Delta: logprobs must be parallel to token_ids")
        if (kwargs.get("logprobs") is not None or kwargs.get("prompt_logprobs") is not None) and \
                kwargs.get("token_texts") is None:
            raise ProtocolError("Delta: logprobs come with the token_texts of the tokens they name")
    return _TYPES[name](**kwargs)


def _not_a_map(name: str, field_name: str) -> Any:
    raise ProtocolError(f"{name}.{field_name}: every entry must be a map of fields")


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


_UNPACK = {"one": _unpack_prompt_logprobs, "each": _unpack_each_prompt_logprobs}

_REASONS = {r.value: r for r in FinishReason}


def _unpack_reason(x: Any, name: str) -> FinishReason:
    try:
        return _REASONS[x]
    except (KeyError, TypeError):
        raise ProtocolError(f"field {name!r}: {x!r} is not a finish reason ({', '.join(_REASONS)})") from None


def _unpack_reasons(x: Any, name: str) -> list[FinishReason | None]:
    """A list of finish reasons or None (StepTokens': one per sampled request, every step)."""
    if type(x) is not list:
        raise ProtocolError(f"field {name!r} must be a list")
    try:
        return [None if r is None else _REASONS[r] for r in x]
    except (KeyError, TypeError):
        bad = next(r for r in x if r is not None and (not isinstance(r, str) or r not in _REASONS))
        raise ProtocolError(f"field {name!r}: {bad!r} is not a finish reason ({', '.join(_REASONS)})") from None


def _pack_texts(t: TokenTexts) -> list:
    spelled = t.spelled
    return [pack_ids(list(t.texts)), list(t.texts.values()), [spelled.get(i) for i in t.texts] if spelled else None]


def _unpack_texts(x: Any, name: str) -> TokenTexts:
    try:
        ids_b, texts, spelled = x
    except (TypeError, ValueError):
        raise ProtocolError(f"field {name!r} must be [ids, texts, bytes or None]") from None
    ids = _unpack_ids(ids_b, name)
    if type(texts) is not list or len(texts) != len(ids) or not all(type(t) is str for t in texts):
        raise ProtocolError(f"field {name!r}: one text per id")
    if spelled is None:
        return TokenTexts(dict(zip(ids, texts)), {})
    if type(spelled) is not list or len(spelled) != len(ids) or not all(b is None or type(b) is bytes
                                                                         for b in spelled):
        raise ProtocolError(f"field {name!r}: bytes or None per id")
    return TokenTexts(dict(zip(ids, texts)), {i: b for i, b in zip(ids, spelled) if b is not None})


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


def _spec(cls: type) -> list[_FieldSpec]:
    hints = typing.get_type_hints(cls)
    return [_FieldSpec(f.name, hints[f.name], _checker(hints[f.name]),
                       f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                       f.metadata["of"].__name__ if "of" in f.metadata else None, *_wire_form(f, hints[f.name]))
            for f in dataclasses.fields(cls)]


def _wire_form(f: dataclasses.Field, hint: Any) -> tuple[Callable | None, Callable | None]:
    """(pack, unpack) of a field whose wire form is not its value as msgpack carries it."""
    if f.metadata.get("ids"):
        return pack_ids, _unpack_ids
    if f.metadata.get("texts"):
        return _pack_texts, _unpack_texts
    if "plps" in f.metadata:
        return None, _UNPACK[f.metadata["plps"]]     # a PromptLogprobs is a tuple: msgpack's array as it is
    if hint == (FinishReason | None):
        return None, _unpack_reason                  # a FinishReason is a str: msgpack's string as it is
    if hint == list[FinishReason | None]:
        return None, _unpack_reasons
    assert FinishReason not in typing.get_args(hint), f"{f.name}: no wire form for {hint}"
    return None, None
