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
from mii_async.outputs import FinishReason, Logprob, TokenTexts
from mii_async.params import SamplingParams
from tests.packed_logprobs import pack

PLPS = pack([(-2.5, [(3, -0.125), (9, -3.0)])], 2)     # a 2-token prompt's, 2 alternatives
TEXTS = TokenTexts({1: "a", 3: "é", 9: "\ufffd"}, {9: b"\xe4"})   # the texts of the ids PLPS and [1, 3] name

SAMPLES = [
    p.Generate(req_id="r1", prompt="héllo 你好", params=SamplingParams(max_new_tokens=3, stop=["\n"]).to_wire()),
    p.Generate(req_id="r2", prompt_ids=[0, 1, 2**32 - 1]),
    p.Generate(req_id="r3", messages=[{"role": "user", "content": "hi"}]),
    p.Abort(req_id="r1"),
    p.Delta(req_id="r1", text="text", token_ids=[5, 6], logprobs=[[-0.1, [[5, -0.1]], 1], [-2.0, [[5, -0.1]], 3]],
            finish_reason=FinishReason.STOP, usage={"prompt_tokens": 3}, token_texts=TokenTexts({5: "te", 6: "xt"})),
    p.DeltaBatch(deltas=[p.Delta(req_id="r1", text="a", token_ids=[5]),
                         p.Delta(req_id="r2", text="", token_ids=[], finish_reason=FinishReason.LENGTH,
                                 usage={"prompt_tokens": 3}, prompt_ids=[1, 2]),
                         p.Delta(req_id="r3", text="é", token_ids=[7], logprobs=[[-0.5, [], None]],
                                 token_texts=TokenTexts({7: "é"}))]),
    p.DeltaBatch(deltas=[]),
    p.ErrorReply(req_id="r1", code="invalid_parameter", message="temperature: must be ≥ 0", param="temperature"),
    p.ErrorReply(req_id=None, code="bad_frame", message="not msgpack"),
    p.AddRequest(req_id=7, prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0.5).to_wire()),
    p.AbortRequest(req_id=7),
    p.StepTokens(req_ids=[7, 8], token_ids=[11, 12], finish_reasons=[None, FinishReason.LENGTH], cached_tokens=[0, 16],
                 logprobs=[None, [-0.5, [[12, -0.5]], 1]]),
    p.StepTokens(req_ids=[7, 8], token_ids=[11, 12], finish_reasons=[None, None], cached_tokens=[0, 0],
                 prompt_logprobs=[PLPS, None]),
    p.Delta(req_id="r1", text="a", token_ids=[5], prompt_ids=[1, 3], prompt_logprobs=PLPS, token_texts=TEXTS),
    p.Delta(req_id="r1", text="a", token_ids=[5], prompt_ids=[1], prompt_logprobs=pack([], 0),
            token_texts=TokenTexts({1: "a"})),
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
    delta = p.Delta(req_id="r", text="", token_ids=[5], prompt_ids=[1, 3], prompt_logprobs=PLPS, token_texts=TEXTS)
    frame = msgpack.unpackb(p.encode(delta))
    assert frame["prompt_logprobs"] == [2, b"\x00\x00\x20\xc0", bytes([3, 0, 0, 0, 9, 0, 0, 0]),
                                        b"\x00\x00\x00\xbe\x00\x00\x40\xc0", bytes([2, 0, 0, 0])]
    d = p.decode(p.encode(delta))
    assert d.prompt_logprobs.to_logprobs(d.prompt_ids) == [None, Logprob(3, -2.5, [(3, -0.125), (9, -3.0)], 2)]
    assert pack([(-1.0, [])] * 3, 0).to_logprobs([1, 2, 3, 4]) == [None] + [Logprob(t, -1.0, [], 1) for t in (2, 3, 4)]


def _delta_frame(plps, prompt_ids=(1, 3)):
    return msgpack.packb({"v": V, "t": "Delta", "req_id": "r", "text": "", "token_ids": b"",
                          "prompt_ids": packed.pack_ids(list(prompt_ids)), "prompt_logprobs": plps,
                          "token_texts": [packed.pack_ids([1, 3, 9]), ["a", "é", "\ufffd"], None]})


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
    frame = msgpack.unpackb(p.encode(p.AddRequest(req_id=1, prompt_ids=list(range(1000)),
                                                  params=SamplingParams().to_wire())))
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


def test_finish_reasons_decode_into_the_enum_and_an_unknown_one_is_refused():
    """A finish reason travels as its string and decodes into the FinishReason (a Delta's and each of a
    StepTokens'), which is still that string (==, hash, str, format, JSON); an unknown one is a bad frame."""
    for r in FinishReason:
        d = p.decode(p.encode(p.Delta(req_id="r", text="", finish_reason=r)))
        assert d.finish_reason is r and d.finish_reason == r.value and r.value in {d.finish_reason}
        assert str(r) == f"{r}" == r.value and msgpack.unpackb(p.encode(d))["finish_reason"] == r.value
    st = p.decode(p.encode(p.StepTokens(req_ids=[1, 2], token_ids=[3, 4], finish_reasons=["stop", None],
                                        cached_tokens=[0, 0])))
    assert st.finish_reasons == [FinishReason.STOP, None] and st.finish_reasons[0] is FinishReason.STOP
    with pytest.raises(p.ProtocolError, match="'done' is not a finish reason"):
        p.decode(msgpack.packb({"v": V, "t": "Delta", "req_id": "r", "text": "", "finish_reason": "done"}))
    step = {"v": V, "t": "StepTokens", "req_ids": [1, 2], "token_ids": packed.pack_ids([3, 4]), "cached_tokens": [0, 0]}
    for bad in (["stop", "STOP"], [None, 5], [["stop"], None], "stop"):
        with pytest.raises(p.ProtocolError, match="finish_reasons"):
            p.decode(msgpack.packb({**step, "finish_reasons": bad}))


def test_a_deltas_logprobs_come_with_the_texts_of_the_tokens_they_name():
    """A Delta's logprobs are one wire form per token (Logprob.to_wire, the id in token_ids) and its
    token_texts travel as [packed ids, texts, bytes where not the text's UTF-8]; they decode into Logprobs whose
    texts and bytes are the router's. Logprobs without texts, or not one per token, are a bad frame."""
    lp = Logprob(5, -0.25, [(5, -0.25), (9, -2.0)], 1)
    texts = TokenTexts({5: "é", 9: "\ufffd"}, {9: b"\xc3"})
    frame = msgpack.unpackb(p.encode(p.Delta(req_id="r", text="é", token_ids=[5], logprobs=[lp.to_wire()],
                                             token_texts=texts)))
    assert frame["logprobs"] == [[-0.25, [[5, -0.25], [9, -2.0]], 1]]
    assert frame["token_texts"] == [packed.pack_ids([5, 9]), ["é", "\ufffd"], [None, b"\xc3"]]
    d = p.decode(p.encode(p.Delta(req_id="r", text="é", token_ids=[5], logprobs=[lp.to_wire()], token_texts=texts)))
    [got] = [Logprob.from_wire(t, x, d.token_texts) for t, x in zip(d.token_ids, d.logprobs)]
    assert got == lp and (got.text, got.token_bytes) == ("é", "é".encode())
    assert (got.top_texts, got.top_bytes) == (["é", "\ufffd"], ["é".encode(), b"\xc3"])
    d = p.decode(p.encode(p.Delta(req_id="r", text="", token_ids=[5], prompt_ids=[1, 3], prompt_logprobs=PLPS,
                                  token_texts=TEXTS)))
    [none, first] = d.prompt_logprobs.to_logprobs(d.prompt_ids, d.token_texts)
    assert none is None and (first.text, first.top_texts, first.top_bytes) == ("é", ["é", "\ufffd"],
                                                                                ["é".encode(), b"\xe4"])
    base = {"v": V, "t": "Delta", "req_id": "r", "text": "", "token_ids": packed.pack_ids([5])}
    with pytest.raises(p.ProtocolError, match="token_texts"):
        p.decode(msgpack.packb({**base, "logprobs": [[-0.25, [], 1]]}))
    with pytest.raises(p.ProtocolError, match="parallel"):
        p.decode(msgpack.packb({**base, "logprobs": [[-0.25, [], 1]] * 2, "token_texts": frame["token_texts"]}))
    for bad in ([packed.pack_ids([5]), ["a", "b"], None], [packed.pack_ids([5]), [5], None], [b"abc", ["a"], None],
                [packed.pack_ids([5]), ["a"], ["a"]], [packed.pack_ids([5]), ["a"], []], {"5": "a"}, [1, 2]):
        with pytest.raises(p.ProtocolError, match="token_texts"):
            p.decode(msgpack.packb({**base, "token_texts": bad}))
