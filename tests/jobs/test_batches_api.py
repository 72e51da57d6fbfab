"""The Files and Batches API through the official `openai` package, unmodified, against a real deployment
(tests/conftest.py: the session's router and worker, a gateway process with a jobs_dir of its own)."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

DONE = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def jobs_gateway(start_gateway, tmp_path_factory):
    return start_gateway(jobs_dir=str(tmp_path_factory.mktemp("jobs")))


@pytest.fixture(scope="module")
def oai(jobs_gateway):
    with openai.OpenAI(base_url=f"{jobs_gateway.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def _jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def _wait(oai, batch_id: str, until=DONE, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while True:
        b = oai.batches.retrieve(batch_id)
        if b.status in until:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status} after {timeout_s} s"
        time.sleep(0.2)


def test_openai_flow_chat_and_completions(oai, model):
    """files.create → batches.create → batches.retrieve until completed → files.content: one output line per
    input line, in input order, each answer the same as the route gives the same body (greedy)."""
    questions = ["What is the capital of France?", "Name a colour.", "Count to three.", "Say hello."]
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 12,
                       "temperature": 0}} for i, q in enumerate(questions)]
    f = oai.files.create(file=("chat.jsonl", _jsonl(lines)), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(_jsonl(lines)) and oai.files.retrieve(f.id).id == f.id
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                           metadata={"job": "nightly"})
    assert b.status in ("validating", "in_progress") and b.metadata == {"job": "nightly"}
    b = _wait(oai, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (4, 4, 0)
    assert b.error_file_id is None and b.completed_at >= b.in_progress_at >= b.created_at
    out = [json.loads(x) for x in oai.files.content(b.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == ["q0", "q1", "q2", "q3"]
    for line, x in zip(lines, out):
        assert x["error"] is None and x["response"]["status_code"] == 200 and x["id"].startswith("batch_req_")
        direct = oai.chat.completions.create(**line["body"])
        assert x["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert x["response"]["request_id"] == x["response"]["body"]["id"]
    assert "Paris" in out[0]["response"]["body"]["choices"][0]["message"]["content"]
    # completions, and a line the router refuses at run time (a prompt over the context): the error file
    lines = [{"custom_id": "short", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}},
             {"custom_id": "huge", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": "word " * 20000, "max_tokens": 4}}]
    f2 = oai.files.create(file=("comp.jsonl", _jsonl(lines)), purpose="batch")
    b2 = _wait(oai, oai.batches.create(input_file_id=f2.id, endpoint="/v1/completions",
                                       completion_window="24h").id)
    assert b2.status == "completed" and (b2.request_counts.completed, b2.request_counts.failed) == (1, 1)
    [ok] = [json.loads(x) for x in oai.files.content(b2.output_file_id).text.splitlines()]
    [bad] = [json.loads(x) for x in oai.files.content(b2.error_file_id).text.splitlines()]
    assert ok["custom_id"] == "short" and ok["response"]["body"]["choices"][0]["text"].strip().startswith("Paris")
    assert bad["custom_id"] == "huge" and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["type"] == "invalid_request_error"
    # listing: newest first, paged with after/limit; files listed and deleted
    page = oai.batches.list(limit=1)
    assert [x.id for x in page.data] == [b2.id] and page.has_more
    assert [x.id for x in oai.batches.list(after=b2.id, limit=1).data] == [b.id]
    ids = [x.id for x in oai.files.list()]
    assert {f.id, f2.id, b.output_file_id, b2.output_file_id, b2.error_file_id} <= set(ids)
    assert oai.files.delete(f2.id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(f2.id)
    with pytest.raises(openai.NotFoundError):
        oai.files.content(f2.id)


def test_invalid_lines_fail_the_batch_with_per_line_errors(oai, model):
    """A batch whose file holds a malformed line, a duplicate custom_id, a wrong url, a body the route
    refuses (an unknown field; stream) or another model's name fails validation: status failed, each fault
    in errors.data with its line, and nothing runs."""
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": "hi", "max_tokens": 2}}
    raw = _jsonl([good]) + b"{oops\n" + _jsonl([
        good,
        {**good, "custom_id": "u", "url": "/v1/chat/completions"},
        {**good, "custom_id": "x", "body": {**good["body"], "bogus": 1}},
        {**good, "custom_id": "s", "body": {**good["body"], "stream": True}},
        {**good, "custom_id": "m", "body": {**good["body"], "model": "other/model"}},
        {**good, "custom_id": "t", "body": {**good["body"], "max_tokens": "5"}}])
    f = oai.files.create(file=("bad.jsonl", raw), purpose="batch")
    b = _wait(oai, oai.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None and b.request_counts.total == 0
    got = [(e.line, e.code, e.param) for e in b.errors.data]
    assert got == [(2, "invalid_json_line", None), (3, "duplicate_custom_id", "custom_id"),
                   (4, "invalid_url", "url"), (5, "invalid_request", "body.bogus"),
                   (6, "invalid_request", "body.stream"), (7, "invalid_request", "body.model"),
                   (8, "invalid_request", "body.max_tokens")]


def test_refused_requests_name_the_parameter(oai, jobs_gateway):
    """The routes' own refusals: an unknown input file (404), a wrong endpoint, window, purpose or metadata
    (400 naming it), a non-multipart upload, and an unknown batch (404)."""
    f = oai.files.create(file=("x.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    for kw, param in ((dict(endpoint="/v1/embeddings"), "endpoint"), (dict(completion_window="1h"),
                      "completion_window"), (dict(metadata={"k": 5}), "metadata.k")):
        args = {"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h", **kw}
        with pytest.raises(openai.BadRequestError) as e:
            oai.batches.create(**args)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        oai.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    r = httpx.post(f"{jobs_gateway.url}/v1/files", json={"purpose": "batch"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
    with pytest.raises(openai.NotFoundError):
        oai.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        oai.batches.cancel("batch_nope")


def test_cancel_stops_the_batch_and_keeps_finished_lines(oai, model):
    """Cancelling a running batch: cancelling, then cancelled; lines not yet answered never run, the output file
    holds exactly the lines that finished, and a cancelled batch cannot be cancelled again (409)."""
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"Story number {i}:", "max_tokens": 200, "ignore_eos": True,
                       "temperature": 0}} for i in range(40)]
    f = oai.files.create(file=("long.jsonl", _jsonl(lines)), purpose="batch")
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    _wait(oai, b.id, until=("in_progress",) + DONE)
    c = oai.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled") and c.cancelling_at
    b = _wait(oai, b.id)
    assert b.status == "cancelled" and b.cancelled_at, b
    counts = b.request_counts
    assert counts.total == 40 and counts.completed + counts.failed < 40 and counts.failed == 0
    out = oai.files.content(b.output_file_id).text.splitlines() if b.output_file_id else []
    assert len(out) == counts.completed
    assert len({json.loads(x)["custom_id"] for x in out}) == len(out)
    with pytest.raises(openai.ConflictError):
        oai.batches.cancel(b.id)
