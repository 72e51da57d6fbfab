"""Admission, through the router core without sockets or processes: an admitted request reaches a replica; a
refused one is answered under its id with an error that names the parameter or the bound (limits, bad values,
overload past max_queued_requests or max_queued_tokens, no replica ready)."""
from __future__ import annotations

import json

from mii_async import protocol as P
from mii_async.router.core import ToReplica
from mii_async.text.prompts import MAX_CHARS_PER_TOKEN
from tests.router.core_harness import CONTEXT, VOCAB, Harness, refusal


def test_an_admitted_request_goes_to_a_replica_with_its_ids(tokenizer):
    """A valid Generate is encoded, counted against max_queued_tokens and sent to the replica's leader."""
    h = Harness(tokenizer)
    h.submit("a", "w5 w6 w7", max_new_tokens=10)
    [s] = h.sends()
    assert s == ToReplica(b"w0", s.msg) and isinstance(s.msg, P.AddRequest)
    assert s.msg.prompt_ids == [5, 6, 7] and s.msg.params["max_new_tokens"] == 10
    assert h.core.requests.queued_tokens == 13 and h.replicas.replicas[0].requests == {s.msg.req_id}
    assert h.core.counters["requests"] == 1 and h.core.counters["rejected"] == 0


def test_a_router_that_is_not_ready_refuses_as_unavailable(tokenizer):
    """While starting or draining, a Generate is refused under its id with "unavailable", naming the state."""
    for state in ("starting", "draining"):
        h = Harness(tokenizer, state=state)
        assert h.submit("a") is None
        e = refusal(h.sends())
        assert (e.req_id, e.code) == ("a", "unavailable") and state in e.message
        assert len(h.core.requests) == 0


def test_bad_values_are_refused_naming_the_parameter(tokenizer):
    """A bad sampling parameter, two prompts at once, a token outside the vocabulary, a request longer than
    the context and prompt logprobs too large for one message: each an ErrorReply naming its parameter, and
    nothing reaches a replica."""
    h = Harness(tokenizer)
    cases = [("temperature", "invalid_parameter", dict(params={"temperature": -1.0})),
             ("bogus", "invalid_parameter", dict(params={"bogus": 1})),
             ("prompt", "invalid_parameter", dict(prompt_ids=[5, 6])),              # beside the text prompt
             ("prompt", "invalid_parameter", dict(prompt=None, prompt_ids=[5, VOCAB + 3])),
             ("max_new_tokens", "request_too_long", dict(params={"max_new_tokens": CONTEXT})),
             ("prompt", "request_too_long", dict(prompt=None, prompt_ids=[5] * CONTEXT)),
             ("prompt_logprobs", "request_too_long", dict(prompt=None, prompt_ids=[5] * 30_000,
                                                          params={"prompt_logprobs": 20, "max_new_tokens": 1}))]
    for i, (param, code, fields) in enumerate(cases):
        msg = P.Generate(req_id=f"r{i}", **{"prompt": "w5 w6", **fields})
        job = h.core.client_message(b"c", msg)
        if job is not None:
            h.encode(job)
        e = refusal(h.sends())
        assert (e.req_id, e.code, e.param) == (f"r{i}", code, param), e
    assert len(h.core.requests) == 0 and h.core.requests.queued_tokens == 0
    assert h.core.counters["rejected"] == len(cases)


def test_a_prompt_no_tokenizer_could_fit_is_refused_before_it_is_encoded(tokenizer):
    """A text, or a chat's contents and tools' JSON, of more than MAX_CHARS_PER_TOKEN characters a token of the
    context is refused on arrival as request_too_long naming `prompt` or `messages`, and never reaches the
    encoder; one at the bound is still encoded."""
    h = Harness(tokenizer, context=64)
    bound = MAX_CHARS_PER_TOKEN * 64
    tool = {"type": "function", "function": {"name": "w40"}}
    tool_chars = len(json.dumps([tool], separators=(",", ":")))
    over = [("prompt", dict(prompt="w5 " * (bound // 3) + "w6")),
            ("messages", dict(messages=[{"role": "user", "content": "w5" * (bound // 4)},
                                        {"role": "user", "content": "w6" * (bound // 4) + "w"}])),
            ("messages", dict(messages=[{"role": "user", "content": "w" * (bound + 1 - tool_chars)}], tools=[tool]))]
    for i, (param, fields) in enumerate(over):
        assert h.core.client_message(b"c", P.Generate(req_id=f"r{i}", **fields)) is None
        e = refusal(h.sends())
        assert (e.req_id, e.code, e.param) == (f"r{i}", "request_too_long", param), e
        assert f"{bound + 1} characters cannot fit the context of 64 tokens" in e.message
    assert h.encodes == 0 and len(h.core.requests) == 0
    at = [dict(prompt="w5 " * (bound // 3) + "w"), dict(messages=[{"role": "user", "content": "w5" * (bound // 2)}])]
    for i, fields in enumerate(at):
        job = h.core.client_message(b"c", P.Generate(req_id=f"a{i}", **fields))
        assert job is not None and not h.sends()
        h.encode(job)
        h.sends()
    assert h.encodes == 2


def test_a_live_req_id_is_refused_without_ending_its_stream(tokenizer):
    """A second Generate under a live id is refused under no id (one under it would end the live stream)."""
    h = Harness(tokenizer)
    h.submit("a")
    h.sends()
    h.submit("a")
    e = refusal(h.sends())
    assert (e.req_id, e.param) == (None, "req_id")
    assert h.core.requests.find(b"c", "a") is not None


def test_overload_past_max_queued_requests(tokenizer):
    """Past max_queued_requests live requests (encoding ones too), a Generate is refused at once as
    "overloaded", naming the bound; one ending makes room again."""
    h = Harness(tokenizer, max_queued_requests=2)
    h.submit("a")
    assert h.submit("b", encode=False) is not None          # still encoding: it counts
    h.sends()
    assert h.submit("c") is None
    e = refusal(h.sends())
    assert e.code == "overloaded" and "max_queued_requests=2" in e.message
    assert h.core.counters["overloaded"] == 1
    h.core.abort(b"c", "a")
    h.sends()
    assert h.submit("c") is not None


def test_overload_past_max_queued_tokens(tokenizer):
    """A request whose prompt + max_new_tokens would take the queued tokens past max_queued_tokens is refused
    as "overloaded", naming the bound; once the first finishes, its tokens are free again."""
    h = Harness(tokenizer, max_queued_tokens=100)
    h.submit("a", "w5 w6 w7 w8", max_new_tokens=60)                   # costs 64
    h.sends()
    h.submit("b", "w5 w6 w7 w8", max_new_tokens=40)                   # 64 + 44 > 100
    e = refusal(h.sends())
    assert e.code == "overloaded" and "max_queued_tokens=100" in e.message and "64 tokens queued" in e.message
    h.step(b"w0", {h.rid("a"): 9}, finish={h.rid("a"): "length"})
    h.sends()
    assert h.core.requests.queued_tokens == 0
    h.submit("b", "w5 w6 w7 w8", max_new_tokens=40)
    assert isinstance(h.sends()[0].msg, P.AddRequest)


def test_no_ready_replica_and_an_encoder_error_refuse_the_request(tokenizer):
    """With no replica ready the request is refused as "unavailable"; a prompt the encoder fails on, as an
    invalid prompt that says it could not be encoded."""
    h = Harness(tokenizer, n=0)
    h.submit("a")
    assert refusal(h.sends()).code == "unavailable"
    h.add_replica(0)
    job = h.submit("b", encode=False)
    h.core.encode_failed(job.rid, UnicodeError("odd bytes"))
    e = refusal(h.sends())
    assert (e.req_id, e.param) == ("b", "prompt") and "could not be encoded: odd bytes" in e.message
    assert len(h.core.requests) == 0


def test_a_bad_frame_is_answered_under_its_id(tokenizer):
    """A frame that does not decode is answered with "bad_frame" under the id it shows; a message a client may
    not send, under none."""
    h = Harness(tokenizer)
    err = P.ProtocolError("Generate.params: int does not match dict")
    err.req_id = "x"
    h.core.client_message(b"c", err)
    h.core.client_message(b"c", P.AbortRequest(req_id=3))
    a, b = h.sends()
    assert (a.msg.req_id, a.msg.code) == ("x", "bad_frame")
    assert (b.msg.req_id, b.msg.code) == (None, "bad_frame") and "AbortRequest" in b.msg.message



def test_a_chat_that_fits_the_context_gets_the_room_its_prompt_leaves(tokenizer):
    """fit_context (the gateway's chat without max_tokens) lowers max_new_tokens to what the context and the KV
    pool leave after the prompt, and counts that; without it the same request is refused. A ceiling under the
    room stays; a prompt that leaves no room, or a min_new_tokens past it, is refused naming it."""
    import copy

    words = copy.deepcopy(tokenizer)
    words.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    h = Harness(words)
    info = h.replicas.replicas[0].workers[0].info

    def chat(creq: str, content: str = "w5 w6 w7", fit: bool = True, **params) -> list:
        job = h.core.client_message(b"c", P.Generate(req_id=creq, messages=[{"role": "user", "content": content}],
                                                     params={"max_new_tokens": 4096, **params}, fit_context=fit))
        h.encode(job)
        return h.sends()

    info.update(max_model_len=20, max_request_tokens=CONTEXT)
    [sent] = chat("a")
    assert isinstance(sent.msg, P.AddRequest) and sent.msg.params["max_new_tokens"] == 17
    assert h.core.requests.queued_tokens == 20
    info.update(max_request_tokens=12)                              # a KV pool smaller than the context
    assert chat("b")[0].msg.params["max_new_tokens"] == 9
    assert chat("c", max_new_tokens=5)[0].msg.params["max_new_tokens"] == 5
    e = refusal(chat("d", fit=False))
    assert (e.code, e.param) == ("request_too_long", "max_new_tokens")
    assert refusal(chat("e", min_new_tokens=10)).param == "min_new_tokens"
    e = refusal(chat("f", " ".join(["w5"] * 12)))
    assert (e.code, e.param) == ("request_too_long", "prompt")
