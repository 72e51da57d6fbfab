"""Wire messages: every type round-trips through msgpack; malformed frames raise ProtocolError."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mii_async import protocol as p

SAMPLES = [
    p.Generate("r1", prompt="héllo 你好", params={"max_new_tokens": 3, "stop": ["\n"]}),
    p.Generate("r2", prompt_ids=[0, 1, 2**32 - 1]),
    p.Generate("r3", messages=[{"role": "user", "content": "hi"}]),
    p.Abort("r1"),
    p.Delta("r1", "text", [5, 6], [[5, -0.1, [[5, -0.1]]]], "stop", {"prompt_tokens": 3}, None),
    p.DeltaBatch([p.Delta("r1", "a", [5]), p.Delta("r2", "", [], None, "length", {"prompt_tokens": 3}, None, [1, 2]),
                  p.Delta("r3", "é", [7], [[7, -0.5, []]])]),
    p.DeltaBatch([]),
    p.ErrorReply("r1", "invalid_parameter", "temperature: must be ≥ 0", "temperature"),
    p.ErrorReply(None, "bad_frame", "not msgpack"),
    p.AddRequest(7, [1, 2, 3], {"temperature": 0.5}),
    p.AbortRequest(7),
    p.StepTokens([7, 8], [11, 12], [None, "length"], [0, 16], [None, [-0.5, [[12, -0.5]]]]),
    p.StepTokens([7, 8], [11, 12], [None, None], [0, 0], None, [[None, [-2.5, [[3, -0.1]]]], None]),
    p.Delta("r1", "a", [5], None, None, None, None, [1, 3], [None, [3, -2.5, [[3, -2.5], [9, -3.0]]]]),
    p.Ready(0, 1, {"num_blocks": 10}),
    p.Heartbeat(0, {"used_blocks": 3}),
    p.RequestFailed(7, "boom"),
    p.Shutdown(2.5),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    """decode(encode(m)) == m for every message type."""
    assert p.decode(p.encode(msg)) == msg


def test_a_batch_packs_each_deltas_token_ids():
    """A DeltaBatch carries each Delta as a map of its fields, token ids packed, with no version or type."""
    frame = msgpack.unpackb(p.encode(p.DeltaBatch([p.Delta("r1", "a", [5, 6])])))
    assert frame["deltas"][0]["token_ids"] == bytes([5, 0, 0, 0, 6, 0, 0, 0])
    assert "v" not in frame["deltas"][0] and "t" not in frame["deltas"][0]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 20])
def test_prompt_logprobs_bytes_bounds_the_encoded_size(n):
    """prompt_logprobs_bytes is an upper bound on what a prompt's logprobs (largest ids, float64s) and its
    packed ids add to a Delta, and on what they add to a StepTokens."""
    top = [[2**32 - 1, -1.0 / 3]] * n
    plps = [None] + [[2**32 - 1, -1.0 / 3, top]] * 999
    ids = [2**32 - 1] * 1000
    bare = len(p.encode(p.Delta("r", "", [5])))
    assert len(p.encode(p.Delta("r", "", [5], None, None, None, None, ids, plps))) - bare <= \
        p.prompt_logprobs_bytes(1000, n)
    bare = len(p.encode(p.StepTokens([1], [5], [None], [0])))
    assert len(p.encode(p.StepTokens([1], [5], [None], [0], None, [[e and e[1:] for e in plps]]))) - bare <= \
        p.prompt_logprobs_bytes(1000, n)


def test_token_ids_are_packed():
    """Token ids travel as a packed uint32 array: 4 bytes each, not a msgpack list."""
    frame = msgpack.unpackb(p.encode(p.AddRequest(1, list(range(1000)))))
    assert isinstance(frame["prompt_ids"], bytes) and len(frame["prompt_ids"]) == 4000


V = p.PROTOCOL_VERSION
BAD = [
    b"", b"\xc1", b"\x00", msgpack.packb([1, 2]),
    msgpack.packb({"v": 99, "t": "Abort", "req_id": "x"}),
    msgpack.packb({"v": V, "t": "Pickle", "req_id": "x"}),
    msgpack.packb({"v": V, "t": "Abort"}),
    msgpack.packb({"v": V, "t": "Abort", "req_id": 5}),
    msgpack.packb({"v": V, "t": "Abort", "req_id": "x", "extra": 1}),
    msgpack.packb({"v": V, "t": "AddRequest", "req_id": 1, "prompt_ids": b"abc"}),
    msgpack.packb({"v": V, "t": "AddRequest", "req_id": True, "prompt_ids": b""}),
    msgpack.packb({"v": V, "t": "StepTokens", "req_ids": ["a"], "token_ids": b""}),
    msgpack.packb({"v": V, "t": "StepTokens", "req_ids": [1], "token_ids": b"", "cached_tokens": [True]}),
    msgpack.packb({"v": V, "t": "Abort", "req_id": "x", b"raw": 1}),
    msgpack.packb({"v": V, "t": "DeltaBatch", "deltas": [{"req_id": "a", "text": 5}]}),
    msgpack.packb({"v": V, "t": "DeltaBatch", "deltas": [{"req_id": "a"}]}),
    msgpack.packb({"v": V, "t": "DeltaBatch", "deltas": [{"req_id": "a", "text": "", "token_ids": b"abc"}]}),
    msgpack.packb({"v": V, "t": "DeltaBatch", "deltas": [{"v": V, "t": "Delta", "req_id": "a", "text": ""}]}),
    msgpack.packb({"v": V, "t": "DeltaBatch", "deltas": ["Delta"]}),
    msgpack.packb({"v": V, "t": "DeltaBatch", "deltas": {"req_id": "a", "text": ""}}),
    msgpack.packb({"v": V, "t": "DeltaBatch", "deltas": [{"req_id": "a", "text": ""}] * (p.MAX_BATCH_DELTAS + 1)}),
    msgpack.ExtType(1, b"x").data,
]


@pytest.mark.parametrize("frame", BAD)
def test_malformed_frames_raise_protocol_error(frame):
    """Bad version, unknown type, missing/extra/mistyped fields, bad packing, non-msgpack: ProtocolError."""
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


def test_a_frame_of_another_protocol_version_is_refused_naming_both():
    """A peer of the previous protocol version (no prompt logprobs) gets a ProtocolError that names the
    versions."""
    with pytest.raises(p.ProtocolError, match=f"protocol version {V - 1} is not {V}"):
        p.decode(msgpack.packb({"v": V - 1, "t": "Abort", "req_id": "x"}))


def test_oversize_frame_is_refused():
    """A frame over MAX_FRAME_BYTES is refused before it is parsed."""
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.decode(b"\x00" * (p.MAX_FRAME_BYTES + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_other_errors(data):
    """Any byte string either decodes to a message or raises ProtocolError, nothing else."""
    try:
        p.decode(data)
    except p.ProtocolError:
        pass
