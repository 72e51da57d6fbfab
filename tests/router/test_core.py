"""The router core without sockets or processes: balancing by outstanding work, streaming a step's tokens
(one frame per client, stop strings, malformed logprobs, strays), and ending requests (abort, a refusal by the
replica, a silent client, a dead replica, shutdown)."""
from __future__ import annotations

from mii_async import protocol as P
from mii_async.outputs import Logprob
from mii_async.router.core import ToClient, ToReplica
from tests.packed_logprobs import pack
from tests.router.core_harness import Harness, refusal


# -- balancing -----------------------------------------------------------------------------------------
def test_requests_go_to_the_replica_with_the_least_outstanding_work(tokenizer):
    """A long request loads replica 0; the next goes to replica 1, and so on by outstanding tokens (prompt +
    max_new_tokens, less what was generated)."""
    h = Harness(tokenizer, n=2, max_queued_tokens=10_000)
    h.submit("long", "w5 w6 w7", max_new_tokens=2000)
    h.submit("short", "w8 w9", max_new_tokens=10)
    h.submit("next", "w10", max_new_tokens=10)
    to = [s.peer for s in h.sends()]
    assert to == [b"w0", b"w1", b"w1"]
    assert [h.core.requests.load(r) for r in h.replicas.ready()] == [2003, 23]
    h.step(b"w0", {h.rid("long"): 11})
    h.sends()
    assert h.core.requests.load(h.replicas.replicas[0]) == 2002


def test_a_dead_replica_takes_no_new_requests(tokenizer):
    """Once a replica is failed, new requests go to the others."""
    h = Harness(tokenizer, n=2)
    rep0 = h.replicas.replicas[0]
    rep0.state = "dead"
    h.core.fail_replica(rep0, "gone")
    for i in range(3):
        h.submit(f"r{i}")
    assert {s.peer for s in h.sends()} == {b"w1"}


# -- streaming -------------------------------------------------------------------------------------------
def test_a_clients_tokens_of_one_step_leave_in_one_frame(tokenizer):
    """Two requests of one client in a step make one DeltaBatch; another client's request its own Delta; the
    first Delta carries the prompt's ids, the last the finish reason and usage, and the finished request is
    forgotten."""
    h = Harness(tokenizer)
    h.submit("a", "w5 w6")
    h.submit("b", "w7")
    h.submit("z", "w8", peer=b"other")
    h.sends()
    a, b, z = h.rid("a"), h.rid("b"), h.rid("z", b"other")
    h.step(b"w0", {a: 10, b: 11, z: 12}, finish={b: "length"})
    sends = h.sends()
    assert [s.peer for s in sends] == [b"c", b"other"]
    batch, single = sends[0].msg, sends[1].msg
    assert isinstance(batch, P.DeltaBatch) and [d.req_id for d in batch.deltas] == ["a", "b"]
    da, db = batch.deltas
    assert da.text.strip() == "w10" and da.token_ids == [10] and da.prompt_ids == [5, 6]
    assert db.finish_reason == "length" and db.usage["completion_tokens"] == 1
    assert isinstance(single, P.Delta) and single.req_id == "z"
    assert h.core.requests.find(b"c", "b") is None and h.core.requests.find(b"c", "a") is not None


def test_tokens_from_anyone_but_the_serving_leader_are_dropped(tokenizer):
    """A StepTokens from a peer that is not the request's replica leader (a stray, a dead generation) streams
    nothing."""
    h = Harness(tokenizer, n=2)
    h.submit("a")
    h.sends()
    h.step(b"w1", {h.rid("a"): 9})
    h.step(b"nobody", {h.rid("a"): 9})
    assert h.sends() == []


def test_a_stop_string_ends_the_request_and_aborts_it_at_the_replica(tokenizer):
    """A stop string completed by a token ends the stream with "stop" here, and the replica is told to abort
    the request (it would run on to max_new_tokens)."""
    h = Harness(tokenizer)
    h.submit("a", stop=["w9"])
    h.sends()
    rid = h.rid("a")
    h.step(b"w0", {rid: 8})
    h.step(b"w0", {rid: 9})
    sends = h.sends()
    assert ToReplica(b"w0", P.AbortRequest(req_id=rid)) in sends
    last = [s.msg for s in sends if isinstance(s, ToClient)][-1]
    assert last.finish_reason == "stop" and "w9" not in last.text
    assert len(h.core.requests) == 0


def test_malformed_logprobs_end_only_their_request(tokenizer):
    """A replica's logprobs entry that is malformed (more alternatives than asked) ends that request with an
    error and aborts it at the replica; the other request of the step streams on."""
    h = Harness(tokenizer)
    h.submit("a", logprobs=1)
    h.submit("b", logprobs=1)
    h.sends()
    a, b = h.rid("a"), h.rid("b")
    good = [-0.1, [[9, -0.1]], 1]
    bad = [-0.1, [[9, -0.1], [8, -2.0]], 1]
    h.core.step_tokens(b"w0", P.StepTokens(req_ids=[a, b], token_ids=[9, 9], finish_reasons=[None, None],
                                           cached_tokens=[0, 0], logprobs=[bad, good]))
    sends = h.sends()
    assert ToReplica(b"w0", P.AbortRequest(req_id=a)) in sends
    deltas = [d for s in sends if isinstance(s, ToClient)
              for d in (s.msg.deltas if isinstance(s.msg, P.DeltaBatch) else [s.msg])]
    ended = next(d for d in deltas if d.req_id == "a")
    assert ended.finish_reason == "error" and "malformed logprobs" in ended.error
    streamed = next(d for d in deltas if d.req_id == "b")
    assert streamed.finish_reason is None and streamed.logprobs == [[-0.1, [[9, -0.1]], 1]]


def test_a_deltas_logprobs_carry_the_texts_of_the_tokens_they_name(tokenizer):
    """The router, which holds the tokenizer, sends with a Delta's logprobs the text (decode([id])) and bytes of
    its token and of every alternative, and, with prompt logprobs, of the prompt's ids and their alternatives:
    just those ids. A Delta without logprobs carries none."""
    h = Harness(tokenizer)
    h.submit("a", "w5 w6 w7", logprobs=2, prompt_logprobs=1)
    h.submit("b", "w5 w6")
    h.sends()
    a, b = h.rid("a"), h.rid("b")
    plps = pack([(-1.0, [(40, -0.5)]), (-2.0, [(41, -0.25)])], 1)
    h.core.step_tokens(b"w0", P.StepTokens(req_ids=[a, b], token_ids=[9, 9], finish_reasons=[None, None],
                                           cached_tokens=[0, 0], logprobs=[[-0.1, [[9, -0.1], [12, -3.0]], 1], None],
                                           prompt_logprobs=[plps, None]))
    deltas = {d.req_id: d for s in h.sends() for d in (s.msg.deltas if isinstance(s.msg, P.DeltaBatch) else [s.msg])}
    texts = deltas["a"].token_texts
    assert sorted(texts.texts) == [5, 6, 7, 9, 12, 40, 41]
    assert all(texts.text(i) == tokenizer.decode([i]) == f"w{i}" for i in texts.texts)
    assert texts.token_bytes(12) == b"w12" and deltas["b"].token_texts is None
    d = P.decode(P.encode(deltas["a"]))
    [lp] = [Logprob.from_wire(t, x, d.token_texts) for t, x in zip(d.token_ids, d.logprobs)]
    assert (lp.text, lp.top_texts) == ("w9", ["w9", "w12"])
    assert [x and x.top_texts for x in d.prompt_logprobs.to_logprobs(d.prompt_ids, d.token_texts)] == [
        None, ["w40"], ["w41"]]


# -- ending --------------------------------------------------------------------------------------------
def test_an_abort_ends_the_stream_and_frees_the_replica(tokenizer):
    """A client's Abort sends the replica an AbortRequest and the client a final "abort" Delta; the request's
    queued tokens and its place on the replica are freed; its late tokens are dropped."""
    h = Harness(tokenizer)
    h.submit("a")
    h.sends()
    rid = h.rid("a")
    h.core.client_message(b"c", P.Abort(req_id="a"))
    to_replica, to_client = h.sends()
    assert to_replica == ToReplica(b"w0", P.AbortRequest(req_id=rid))
    assert to_client.msg.req_id == "a" and to_client.msg.finish_reason == "abort"
    assert h.core.requests.queued_tokens == 0 and h.replicas.replicas[0].requests == set()
    h.step(b"w0", {rid: 9})
    assert h.sends() == []


def test_an_abort_while_encoding_sends_nothing_to_a_replica(tokenizer):
    """A request aborted while its prompt is encoded ends at once; its ids, when they come, go nowhere."""
    h = Harness(tokenizer)
    job = h.submit("a", encode=False)
    h.core.abort(b"c", "a")
    [s] = h.sends()
    assert s.msg.finish_reason == "abort"
    h.encode(job)
    assert h.sends() == [] and len(h.core.requests) == 0


def test_a_dead_replica_fails_its_in_flight_requests_with_a_clear_error(tokenizer):
    """A replica's death ends each of its requests with finish_reason "error" naming the replica and why; the
    other replica's requests go on; the dead replica is not sent aborts."""
    h = Harness(tokenizer, n=2)
    for i in range(4):
        h.submit(f"r{i}", max_new_tokens=100)
    on = {s.msg.req_id: s.peer for s in h.sends()}
    rep0 = h.replicas.replicas[0]
    victims = {rid for rid, peer in on.items() if peer == b"w0"}
    assert victims == rep0.requests and 0 < len(victims) < 4
    rep0.state = "dead"
    h.core.fail_replica(rep0, "worker exited (SIGKILL)")
    sends = h.sends()
    assert all(isinstance(s, ToClient) for s in sends) and len(sends) == len(victims)
    for s in sends:
        assert s.msg.finish_reason == "error" and s.msg.error == "replica 0 failed: worker exited (SIGKILL)"
    assert len(h.core.requests) == 4 - len(victims) and rep0.requests == set()
    assert h.core.counters["failed"] == len(victims) and h.core.counters["replica_deaths"] == 1
    survivor = next(rid for rid, peer in on.items() if peer == b"w1")
    h.step(b"w1", {survivor: 9})
    assert len(h.sends()) == 1


def test_a_request_the_replica_refuses_is_refused_naming_the_parameter(tokenizer):
    """A RequestFailed with a parameter before any token is an ErrorReply naming it (as at submission); without
    one, or after tokens streamed, the stream ends with finish_reason "error"."""
    h = Harness(tokenizer)
    h.submit("a")
    h.submit("b")
    h.sends()
    a, b = h.rid("a"), h.rid("b")
    h.core.request_failed(b"w0", P.RequestFailed(req_id=a, message="the guide cannot be followed",
                                                 param="guided_regex"))
    e = refusal(h.sends())
    assert (e.req_id, e.code, e.param) == ("a", "invalid_parameter", "guided_regex")
    h.step(b"w0", {b: 9})
    h.sends()
    h.core.request_failed(b"w0", P.RequestFailed(req_id=b, message="out of blocks"))
    [s] = h.sends()
    assert s.msg.finish_reason == "error" and s.msg.error == "out of blocks"
    assert h.core.counters["rejected"] == 1 and h.core.counters["failed"] == 1


def test_a_silent_client_loses_its_requests(tokenizer):
    """Past the client timeout, a client not heard from has its requests aborted at the replica and ended;
    a client heard from recently keeps its own."""
    h = Harness(tokenizer)
    h.core.heard_from(b"c", 0.0)
    h.core.heard_from(b"other", 25.0)
    h.submit("a")
    h.submit("b", peer=b"other")
    h.sends()
    a = h.rid("a")
    h.core.expire_clients(30.5, 30.0)
    to_replica, to_client = h.sends()
    assert to_replica == ToReplica(b"w0", P.AbortRequest(req_id=a))
    assert to_client.peer == b"c" and to_client.msg.finish_reason == "abort"
    assert to_client.msg.error == "client timed out"
    assert h.core.requests.find(b"other", "b") is not None and b"c" not in h.core.client_seen


def test_shutdown_aborts_every_live_request(tokenizer):
    """abort_all ends every live request, encoding or dispatched, with "abort" and the reason."""
    h = Harness(tokenizer)
    h.submit("a")
    h.submit("b", encode=False)
    h.sends()
    h.core.abort_all("the deployment is shutting down")
    ends = [s.msg for s in h.sends() if isinstance(s, ToClient)]
    assert sorted(d.req_id for d in ends) == ["a", "b"]
    assert all(d.finish_reason == "abort" and d.error == "the deployment is shutting down" for d in ends)
    assert len(h.core.requests) == 0 and h.core.requests.queued_tokens == 0


# -- prompts ---------------------------------------------------------------------------------------------
# Prints the tools' names, then each message's content: a template that shows tools, over the word tokenizer
SHOWS_TOOLS = "{% for t in tools or [] %}{{ t.function.name }} {% endfor %}{% for m in messages %}{{ m.content }} " \
              "{% endfor %}"
IGNORES_TOOLS = "{% for m in messages %}{{ m.content }} {% endfor %}"


def _templated(tokenizer, template: str, *special: str):
    import copy

    t = copy.deepcopy(tokenizer)
    t.chat_template = template
    if special:
        t.add_special_tokens({"additional_special_tokens": list(special)})
    return t


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def _chat(h: Harness, creq: str, content: str = "w5 w6", **fields) -> P.Message:
    """A chat Generate through the core; what it sends (an AddRequest, or an ErrorReply) is returned."""
    job = h.core.client_message(b"c", P.Generate(req_id=creq, messages=[{"role": "user", "content": content}],
                                                 params={"max_new_tokens": 4}, **fields))
    if job is not None:
        h.encode(job)
    [s] = h.sends()
    return s.msg


def test_a_chat_is_rendered_with_the_tools_its_generate_carries(tokenizer):
    """The router renders a Generate's tools with its messages: natively where the template shows tools, as
    our own system section (saying how many calls an answer may make) where it ignores them."""
    h = Harness(_templated(tokenizer, SHOWS_TOOLS))
    assert _chat(h, "a", tools=[_tool("w40"), _tool("w41")]).prompt_ids == [40, 41, 5, 6]
    assert _chat(h, "b").prompt_ids == [5, 6]
    from mii_async.text.chat_tools import render_chat

    ignoring = _templated(tokenizer, IGNORES_TOOLS)
    h = Harness(ignoring)
    messages, tools = [{"role": "user", "content": "w5 w6"}], [_tool("w40")]
    for parallel in (True, False):
        text = render_chat(ignoring, messages, tools, parallel)
        assert ("Make at most one call." in text) is not parallel and text.endswith("w5 w6 ")
        sent = _chat(h, f"p{parallel}", tools=tools, parallel_tool_calls=parallel)
        assert sent.prompt_ids == ignoring(text, add_special_tokens=False)["input_ids"]
    assert _chat(h, "plain").prompt_ids == [5, 6]


def test_tools_with_a_text_prompt_or_malformed_are_refused_naming_them(tokenizer):
    """Tools go with a chat; a tool without a function name is named by its index."""
    h = Harness(_templated(tokenizer, SHOWS_TOOLS))
    assert h.core.client_message(b"c", P.Generate(req_id="t", prompt="w5", tools=[_tool("w40")])) is None
    assert refusal(h.sends()).param == "tools"
    e = _chat(h, "m", tools=[_tool("w40"), {"type": "function", "function": {"description": "no name"}}])
    assert isinstance(e, P.ErrorReply) and (e.req_id, e.code, e.param) == ("m", "invalid_parameter", "tools[1]")
    assert len(h.core.requests) == 0


def test_an_answer_read_for_calls_keeps_special_call_markers(tokenizer):
    """keep_tool_markers turns skip_special_tokens off where the tokenizer holds <tool_call> as a special
    token (it would be cut out of the answer before it is parsed), and only there."""
    special = Harness(_templated(tokenizer, SHOWS_TOOLS, "<tool_call>", "</tool_call>"))
    plain = Harness(_templated(tokenizer, SHOWS_TOOLS))
    tools = [_tool("w40")]
    assert _chat(special, "a", tools=tools, keep_tool_markers=True).params["skip_special_tokens"] is False
    assert _chat(special, "b", tools=tools).params["skip_special_tokens"] is True
    assert _chat(plain, "c", tools=tools, keep_tool_markers=True).params["skip_special_tokens"] is True
