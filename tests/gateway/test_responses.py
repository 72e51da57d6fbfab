"""The Responses API through the official `openai` package, unmodified (responses.create / .stream / .parse,
retrieve, delete), against a real gateway of the default model; and the store's bounds."""
from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from mii_async.gateway.responses_store import MemoryResponseStore, StoredResponse

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}


def _chat(oai, model, messages, **kw) -> str:
    r = oai.chat.completions.create(model=model, messages=messages, temperature=0, **kw)
    return r.choices[0].message.content


def test_create_answers_as_the_chat_it_stands_for(oai, model):
    """Text input with instructions: the output text is the greedy chat answer to [system, user], with its usage;
    a list of message items (content parts) reads the same."""
    r = oai.responses.create(model=model, input="What is the capital of France?", instructions="Answer briefly.",
                             max_output_tokens=12, temperature=0)
    chat = oai.chat.completions.create(model=model, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text == chat.choices[0].message.content and r.output[0].type == "message"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    items = oai.responses.create(model=model, instructions="Answer briefly.", max_output_tokens=12, temperature=0,
                                 input=[{"role": "user", "content": [{"type": "input_text",
                                                                      "text": "What is the capital of France?"}]}])
    assert items.output_text == r.output_text


def test_stored_responses_continue_and_can_be_deleted(oai, model):
    """previous_response_id continues the stored conversation (the chat over every turn); retrieve gives the
    stored response; store false keeps nothing; delete forgets, and then both are 404s naming the id."""
    first = oai.responses.create(model=model, input="My name is Ada. Say hello.", max_output_tokens=8, temperature=0)
    second = oai.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=8, temperature=0)
    expected = _chat(oai, model, [{"role": "user", "content": "My name is Ada. Say hello."},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "What is my name?"}], max_tokens=8)
    assert second.output_text == expected and second.previous_response_id == first.id
    got = oai.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    unstored = oai.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    oai.responses.delete(first.id)
    for rid in (first.id, unstored.id):
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=model, input="Hi", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(first.id)


def test_stream_events_add_up_to_the_response(oai, model):
    """responses.stream: created, in_progress, the message's events, completed; the deltas add up to the text
    of the final response, which equals the one created without stream."""
    kw = dict(model=model, input="Name three colours.", max_output_tokens=10, temperature=0)
    plain = oai.responses.create(**kw)
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response() if plain.status == "completed" else None
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == f"response.{plain.status}" and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    if final is not None:
        assert final.output_text == text


def test_incomplete_at_max_output_tokens_and_logprobs(oai, model):
    """max_output_tokens cutting the answer leaves the response incomplete (reason max_output_tokens); logprobs
    come with the output text, one per token, when include asks."""
    r = oai.responses.create(model=model, input="Tell me a long story.", max_output_tokens=3, temperature=0,
                             include=["message.output_text.logprobs"], top_logprobs=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens == 3 and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert b"".join(bytes(lp.bytes) for lp in lps).decode() == r.output_text


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


def test_parse_guides_the_text_into_the_format(oai, model):
    """responses.parse with a pydantic text_format: the text is guided into its schema and parsed."""
    r = oai.responses.parse(model=model, input="Which city is the capital of France?", text_format=City,
                            max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, City)
    with oai.responses.stream(model=model, input="Which city is the capital of Spain?", text_format=City,
                              max_output_tokens=60, temperature=0) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, City)


def test_function_calls_and_their_outputs(oai, model):
    """A required call is a function_call item with JSON arguments in the tool's schema (streamed: its argument
    deltas add up to the same); its output fed back as a function_call_output continues the conversation."""
    kw = dict(model=model, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
              max_output_tokens=40, temperature=0)
    r = oai.responses.create(**kw)
    [call] = [it for it in r.output if it.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and "city" in json.loads(call.arguments)
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments and json.loads(deltas).keys() == json.loads(call.arguments).keys()
    named = oai.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [it.type for it in named.output] == ["function_call"]
    after = oai.responses.create(model=model, previous_response_id=r.id, max_output_tokens=10, temperature=0,
                                 tools=[WEATHER], input=[{"type": "function_call_output", "call_id": call.call_id,
                                                          "output": json.dumps({"celsius": 21})}])
    assert after.status in ("completed", "incomplete") and after.output_text


def test_refusals_name_the_responses_field(gateway_url, model):
    """What the Responses API holds is named as it holds it: an input item, a tool, text.format, …"""
    url = f"{gateway_url}/v1/responses"
    cases = ((({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
              "input[0].content[0].type"),
             ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
             ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
             ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
             ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
             ({"max_output_tokens": 0}, "max_output_tokens"),
             ({"truncation": "auto"}, "truncation"),
             ({"background": True}, "background"),
             ({"include": ["everything"]}, "include[0]"),
             ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
             ({"frobnicate": 1}, "frobnicate"))
    for extra, param in cases:
        r = httpx.post(url, json={"model": model, "input": "Hi", "max_output_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = httpx.post(url, json={"model": "other/model", "input": "Hi"}, timeout=60)
    assert r.status_code == 404
    r = httpx.post(url, json={"model": model, "input": "Hi", "max_output_tokens": 2, "reasoning": {"effort": "low"},
                              "metadata": {"k": "v"}, "user": "u", "prompt_cache_key": "p", "safety_identifier": "s",
                              "service_tier": "auto", "parallel_tool_calls": False, "max_tool_calls": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["metadata"] == {"k": "v"}, r.text


def test_store_bounds_count_and_bytes():
    """The store keeps at most max_count records and max_bytes of their JSON, dropping the least recently used;
    a record larger than the whole bound is not kept."""
    def record(n: int) -> StoredResponse:
        return StoredResponse({"id": f"r{n}", "pad": "x" * 100}, [{"role": "user", "content": "hi"}])

    store = MemoryResponseStore(max_count=3, max_bytes=10_000)
    for n in range(4):
        store.put(f"r{n}", record(n))
    assert len(store) == 3 and store.get("r0") is None
    assert store.get("r1") is not None                 # now the most recently used
    store.put("r4", record(4))
    assert store.get("r2") is None and store.get("r1") is not None
    size = store.bytes // len(store)
    small = MemoryResponseStore(max_count=100, max_bytes=size * 2)
    for n in range(3):
        small.put(f"r{n}", record(n))
    assert len(small) == 2 and small.get("r0") is None and small.bytes <= size * 2
    small.put("big", StoredResponse({"pad": "y" * (size * 3)}, []))
    assert small.get("big") is None and len(small) == 2
    assert small.delete("r1") and not small.delete("r1") and len(small) == 1
