"""Wire messages: every type round-trips through msgpack; malformed frames raise ProtocolError."""
from __future__ import annotations

import dataclasses
import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mii_async import packed
from mii_async import protocol as p
from mii_async.outputs import Logprob
from tests.packed_logprobs import pack

PLPS = pack([(-2.5, [(3, -0.125), (9, -3.0)])], 2)     # a 2-token prompt's, 2 alternatives

SAMPLES = [
    p.Generate(req_id="r1", prompt="héllo 你好", params={"max_new_tokens": 3, "stop": ["\n"]}),
    p.Generate(req_id="r2", prompt_ids=[0, 1, 2**32 - 1]),
    p.Generate(req_id="r3", messages=[{"role": "user", "content": "hi"}]),
    p.Abort(req_id="r1"),
    p.Delta(req_id="r1", text="text", token_ids=[5, 6], logprobs=[[5, -0.1, [[5, -0.1]], 1]], finish_reason="stop",
            usage={"prompt_tokens": 3}),
    p.DeltaBatch(deltas=[p.Delta(req_id="r1", text="a", token_ids=[5]),
                         p.Delta(req_id="r2", text="", token_ids=[], finish_reason="length", usage={"prompt_tokens": 3},
                                 prompt_ids=[1, 2]),
                         p.Delta(req_id="r3", text="é", token_ids=[7], logprobs=[[7, -0.5, [], None]])]),
    p.DeltaBatch(deltas=[]),
    p.ErrorReply(req_id="r1", code="invalid_parameter", message="temperature: must be ≥ 0", param="temperature"),
    p.ErrorReply(req_id=None, code="bad_frame", message="not msgpack"),
    p.AddRequest(req_id=7, prompt_ids=[1, 2, 3], params={"temperature": 0.5}),
    p.AbortRequest(req_id=7),
    p.StepTokens(req_ids=[7, 8], token_ids=[11, 12], finish_reasons=[None, "length"], cached_tokens=[0, 16],
                 logprobs=[None, [-0.5, [[12, -0.5]], 1]]),
    p.StepTokens(req_ids=[7, 8], token_ids=[11, 12], finish_reasons=[None, None], cached_tokens=[0, 0],
                 prompt_logprobs=[PLPS, None]),
    p.Delta(req_id="r1", text="a", token_ids=[5], prompt_ids=[1, 3], prompt_logprobs=PLPS),
    p.Delta(req_id="r1", text="a", token_ids=[5], prompt_ids=[1], prompt_logprobs=pack([], 0)),
    p.Ready(replica=0, rank=1, info={"num_blocks": 10}),
    p.Heartbeat(replica=0, stats={"used_blocks": 3}),
    p.RequestFailed(req_id=7, message="boom"),
    p.Shutdown(drain_s=2.5),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    """decode(encode(m)) == m for every message type."""
    assert p.decode(p.encode(msg)) == msg


def test_every_message_type_is_in_one_hop_and_in_the_union():
    """Each registered message is declared in exactly one hop's module and is a member of Message, and back."""
    assert set(typing.get_args(p.Message)) == set(p._TYPES.values())
    for name, cls in p._TYPES.items():
        assert (getattr(p.client, name, None) is cls) != (getattr(p.worker, name, None) is cls), name


@pytest.mark.parametrize("name", sorted(p._TYPES))
def test_messages_are_built_by_keyword_only(name):
    """Every field is given by name: a positional argument is a TypeError (a reordered field cannot slip in)."""
    cls = p._TYPES[name]
    names = [f.name for f in dataclasses.fields(cls)]
    assert [f.name for f in dataclasses.fields(cls(**dict.fromkeys(names)))] == names
    with pytest.raises(TypeError, match="positional argument"):
        cls(*[None] * len(names))


def test_a_batch_packs_each_deltas_token_ids():
    """A DeltaBatch carries each Delta as a map of its fields, token ids packed, with no version or type."""
    frame = msgpack.unpackb(p.encode(p.DeltaBatch(deltas=[p.Delta(req_id="r1", text="a", token_ids=[5, 6])])))
    assert frame["deltas"][0]["token_ids"] == bytes([5, 0, 0, 0, 6, 0, 0, 0])
    assert "v" not in frame["deltas"][0] and "t" not in frame["deltas"][0]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 20])
def test_prompt_logprobs_bytes_bounds_the_encoded_size(n):
    """prompt_logprobs_bytes is an upper bound on what a prompt's packed logprobs and its packed ids add to a
    Delta, and on what they add to a StepTokens; it is tight to 0.1 % (4 + 8n bytes a position, 4 an id)."""
    for length in (1, 2, 1000):
        plps = pack([(-1.0 / 3, [(2**32 - 1, -1.0 / 3)] * n)] * (length - 1), n)
        ids = [2**32 - 1] * length
        bare = len(p.encode(p.Delta(req_id="r", text="", token_ids=[5])))
        added = len(p.encode(p.Delta(req_id="r", text="", token_ids=[5], prompt_ids=ids, prompt_logprobs=plps))) - bare
        assert added <= packed.prompt_logprobs_bytes(length, n)
        step = {"req_ids": [1], "token_ids": [5], "finish_reasons": [None], "cached_tokens": [0]}
        bare = len(p.encode(p.StepTokens(**step)))
        assert len(p.encode(p.StepTokens(**step, prompt_logprobs=[plps]))) - bare <= added
    assert packed.prompt_logprobs_bytes(1000, n) - added <= 0.001 * added + 32


def test_prompt_logprobs_travel_packed():
    """A prompt's logprobs travel as [n, own, top_ids, top_logprobs, ranks]: float32 and uint32 little-endian
    bins, not msgpack lists, and decode to Logprobs with the prompt's ids (None first, top best first, the
    rank)."""
    delta = p.Delta(req_id="r", text="", token_ids=[5], prompt_ids=[1, 3], prompt_logprobs=PLPS)
    frame = msgpack.unpackb(p.encode(delta))
    assert frame["prompt_logprobs"] == [2, b"\x00\x00\x20\xc0", bytes([3, 0, 0, 0, 9, 0, 0, 0]),
                                        b"\x00\x00\x00\xbe\x00\x00\x40\xc0", bytes([2, 0, 0, 0])]
    d = p.decode(p.encode(delta))
    assert d.prompt_logprobs.to_logprobs(d.prompt_ids) == [None, Logprob(3, -2.5, [(3, -0.125), (9, -3.0)], 2)]
    assert pack([(-1.0, [])] * 3, 0).to_logprobs([1, 2, 3, 4]) == [None] + [Logprob(t, -1.0, [], 1) for t in (2, 3, 4)]


def _delta_frame(plps, prompt_ids=(1, 3)):
    return msgpack.packb({"v": V, "t": "Delta", "req_id": "r", "text": "", "token_ids": b"",
                          "prompt_ids": packed.pack_ids(list(prompt_ids)), "prompt_logprobs": plps})


@pytest.mark.parametrize("plps", [
    [2, b"\x00" * 4, b"\x00" * 8],                      # three parts
    [2, b"\x00" * 4, b"\x00" * 8, b"\x00" * 4],         # top logprobs shorter than top ids
    [2, b"\x00" * 4, b"\x00" * 4, b"\x00" * 4],         # n = 2 but one alternative
    [1, b"\x00" * 3, b"\x00" * 3, b"\x00" * 3],         # not whole float32s
    [-1, b"", b"", b""], [True, b"\x00" * 4, b"\x00" * 4, b"\x00" * 4], [1, "a", b"", b""],
    [0, [1.0], b"", b""], {"n": 0}, b"",
])
def test_a_delta_with_malformed_prompt_logprobs_is_a_bad_frame(plps):
    """A Delta's prompt logprobs must be well formed (the router checked them; a client refuses the frame)."""
    with pytest.raises(p.ProtocolError, match="prompt_logprobs"):
        p.decode(_delta_frame(plps))


def test_a_delta_with_prompt_logprobs_needs_the_prompts_ids():
    """One position per prompt token after the first, the ids in the same Delta: else a bad frame."""
    good = list(PLPS)
    assert p.decode(_delta_frame(good)).prompt_logprobs == PLPS
    with pytest.raises(p.ProtocolError, match="prompt's ids"):
        p.decode(_delta_frame(good, (1, 3, 4)))
    with pytest.raises(p.ProtocolError, match="prompt's ids"):
        p.decode(msgpack.packb({"v": V, "t": "Delta", "req_id": "r", "text": "", "token_ids": b"",
                                "prompt_logprobs": good}))


def test_step_tokens_keep_a_malformed_entry_for_the_router():
    """A StepTokens entry that is not a PromptLogprobs decodes as it came (the router fails that request
    only); well-formed ones become PromptLogprobs; the field itself must be a list."""
    frame = {"v": V, "t": "StepTokens", "req_ids": [1, 2, 3], "token_ids": packed.pack_ids([5, 6, 7]),
             "finish_reasons": [None] * 3, "cached_tokens": [0] * 3, "logprobs": None,
             "prompt_logprobs": [list(PLPS), [2, b"", b"x", b""], None]}
    msg = p.decode(msgpack.packb(frame))
    assert msg.prompt_logprobs == [PLPS, [2, b"", b"x", b""], None] and type(msg.prompt_logprobs[0]) is p.PromptLogprobs
    with pytest.raises(p.ProtocolError, match="prompt_logprobs"):
        p.decode(msgpack.packb({**frame, "prompt_logprobs": list(PLPS)[1]}))


def test_token_ids_are_packed():
    """Token ids travel as a packed uint32 array: 4 bytes each, not a msgpack list."""
    frame = msgpack.unpackb(p.encode(p.AddRequest(req_id=1, prompt_ids=list(range(1000)))))
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
    """A peer of the previous protocol version (prompt logprobs as lists) gets a ProtocolError that names the
    versions."""
    with pytest.raises(p.ProtocolError, match=f"protocol version {V - 1} is not {V}"):
        p.decode(msgpack.packb({"v": V - 1, "t": "Abort", "req_id": "x"}))


def test_oversize_frame_is_refused():
    """A frame over MAX_FRAME_BYTES is refused before it is parsed."""
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.decode(b"\x00" * (p.MAX_FRAME_BYTES + 1))


def test_a_message_too_large_for_a_frame_is_not_encoded():
    """encode refuses a message over MAX_FRAME_BYTES (FrameTooLarge, a ProtocolError) rather than hand the
    socket a frame that makes the peer drop the whole connection."""
    with pytest.raises(p.FrameTooLarge, match="16 MiB"):
        p.encode(p.Generate(req_id="big", prompt="x" * p.MAX_FRAME_BYTES))
    assert len(p.encode(p.Generate(req_id="ok", prompt="x" * (p.MAX_FRAME_BYTES - 1000)))) <= p.MAX_FRAME_BYTES


def test_a_refused_generate_or_query_keeps_its_req_id():
    """A Generate or Query frame that fails to decode still names its req_id in the ProtocolError, so that the
    refusal can reach its stream; an Abort's (whose id names a live request) and garbage's are None."""
    V = p.PROTOCOL_VERSION
    for kind, want in (("Generate", "g1"), ("Query", "q1"), ("Abort", None)):
        with pytest.raises(p.ProtocolError) as e:
            p.decode(msgpack.packb({"v": V, "t": kind, "req_id": want or "a1", "params": {1: 2}}))
        assert e.value.req_id == want
    with pytest.raises(p.ProtocolError) as e:
        p.decode(msgpack.packb({"v": V, "t": "Generate", "req_id": "g2", "prompt": 5}))
    assert e.value.req_id == "g2"
    with pytest.raises(p.ProtocolError) as e:
        p.decode(b"\xc1garbage")
    assert e.value.req_id is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_other_errors(data):
    """Any byte string either decodes to a message or raises ProtocolError, nothing else."""
    try:
        p.decode(data)
    except p.ProtocolError:
        pass
