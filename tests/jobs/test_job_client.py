"""client.jobs (jobs/job_client.py) against a real deployment (tests/conftest.py: the session's router and
worker): with no gateway on the directory the lines run in the client's own process, with one the gateway runs
them, and a cancel from another process stops a batch wherever it runs."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

import mii_async
from mii_async.errors import InvalidParameterError, UnavailableError
from mii_async.jobs import JobClient, JobLimitError, JobLimits
from mii_async.jobs.store import JobStore, Line

QUESTIONS = ["What is the capital of France?", "Name a colour.", "Say hello."]


@pytest.fixture(scope="module")
def client(deployment):
    c = mii_async.client(deployment.address)
    yield c
    c.close()


def _chat(i: int, q: str) -> dict:
    return {"custom_id": f"q{i}", "body": {"messages": [{"role": "user", "content": q}], "max_tokens": 8,
                                          "temperature": 0}}


def test_without_a_gateway_the_lines_run_in_the_clients_process(client, tmp_path):
    """submit() from plain code with no process holding the directory: this process takes it (runs_lines) and
    runs the lines; results() gives each output line once, and each answer is the greedy answer of the same chat
    through client.generate; progress() from a coroutine ends with the batch completed; close() frees the
    directory."""
    jobs = client.job_client(str(tmp_path))
    b = jobs.submit([_chat(i, q) for i, q in enumerate(QUESTIONS)], metadata={"job": "t"})
    assert b["status"] in ("validating", "in_progress") and b["metadata"] == {"job": "t"}
    assert jobs.runs_lines
    got = list(jobs.results(b["id"]))
    assert sorted(x["custom_id"] for x in got) == ["q0", "q1", "q2"]
    for x in got:
        q = QUESTIONS[int(x["custom_id"][1:])]
        [alone] = client.generate([{"role": "user", "content": q}], max_new_tokens=8, temperature=0)
        assert x["error"] is None and x["response"]["status_code"] == 200
        assert x["response"]["body"]["choices"][0]["message"]["content"] == alone.generated_text, x
    done = jobs.get(b["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert [x["id"] for x in jobs.list()] == [b["id"]]

    async def watch() -> tuple[list[dict], list[dict]]:
        b2 = await jobs.submit([_chat(i, q) for i, q in enumerate(QUESTIONS)])
        snaps = [s async for s in jobs.progress(b2["id"])]
        return snaps, [x async for x in jobs.results(b2["id"])]

    snaps, lines = asyncio.run(watch())
    assert snaps[-1]["status"] == "completed" and snaps[-1]["request_counts"]["completed"] == 3
    done_counts = [s["request_counts"]["completed"] for s in snaps]
    assert done_counts == sorted(done_counts) and len(lines) == 3
    jobs.close()
    JobStore(str(tmp_path)).close()          # the lease was released: an exclusive store opens


def test_bad_input_raises_naming_the_line_and_parameter(client, tmp_path):
    """A bad line, endpoint, metadata or batch id raises InvalidParameterError naming it (list index and body
    field for a list; the 1-based line for a file), as the HTTP routes refuse them, and nothing is stored."""
    jobs = client.job_client(str(tmp_path / "jobs"))
    good = _chat(0, "hi")
    cases = [([good, {"custom_id": "b", "body": {**good["body"], "max_tokens": "5"}}], "lines[1].body.max_tokens"),
             ([good, good], "lines[1].custom_id"),
             ([good, {"custom_id": "s", "body": {**good["body"], "stream": True}}], "lines[1].body.stream"),
             ([good, "text"], "lines[1]"),
             ([], "lines")]
    for lines, param in cases:
        with pytest.raises(InvalidParameterError) as e:
            jobs.submit(lines)
        assert e.value.param == param, (param, str(e.value))
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({**good, "method": "POST", "url": "/v1/completions"}) + "\n")
    with pytest.raises(InvalidParameterError) as e:
        jobs.submit(str(path))                       # a completions line in a chat batch
    assert e.value.param == "url" and "line 1" in str(e.value) and e.value.errors[0]["code"] == "invalid_url"
    for kw, param in ((dict(endpoint="/v1/embeddings"), "endpoint"), (dict(metadata={"k": 5}), "metadata.k")):
        with pytest.raises(InvalidParameterError) as e:
            jobs.submit([good], **kw)
        assert e.value.param == param
    with pytest.raises(InvalidParameterError) as e:
        jobs.get("batch_nope")
    assert e.value.param == "batch_id"
    assert jobs.list() == []
    jobs.close()


def test_a_gateway_holding_the_directory_runs_the_lines(client, start_gateway, tmp_path):
    """With a gateway that opened the directory, submit() only stores the batch (runs_lines is False) and the
    gateway runs it: the output lines are identical to a direct greedy request to the gateway's route."""
    jobs_dir = str(tmp_path)
    gw = start_gateway(jobs_dir=jobs_dir)
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        assert http.get("/v1/batches").status_code == 200          # the gateway opens the store: its lease
        with pytest.raises(UnavailableError):
            JobStore(jobs_dir).close()
        jobs = client.job_client(jobs_dir)
        lines = [{"custom_id": f"c{i}", "body": {"prompt": f"The number {i} is", "max_tokens": 6, "temperature": 0}}
                 for i in range(4)]
        b = jobs.submit(lines, endpoint="/v1/completions")
        got = {x["custom_id"]: x for x in jobs.results(b["id"])}
        assert not jobs.runs_lines
        assert http.get(f"/v1/batches/{b['id']}").json()["request_counts"]["completed"] == 4
        for line in lines:
            alone = http.post("/v1/completions", json=line["body"]).json()
            x = got[line["custom_id"]]["response"]
            assert x["status_code"] == 200 and x["body"]["choices"][0]["text"] == alone["choices"][0]["text"]
    jobs.close()


def test_a_cancel_from_another_process_stops_the_batch(client, tmp_path):
    """Lines running in this process stop when another process (a JobClient with no client, on the same
    directory) cancels the batch: it ends cancelled, with fewer lines answered than it holds, and results()
    gives exactly the lines that finished."""
    jobs = client.job_client(str(tmp_path))
    lines = [{"custom_id": f"c{i}", "body": {"prompt": f"Story number {i}:", "max_tokens": 200, "ignore_eos": True,
                                             "temperature": 0}} for i in range(24)]
    b = jobs.submit(lines, endpoint="/v1/completions")
    deadline = time.monotonic() + 120
    while jobs.get(b["id"])["status"] != "in_progress":
        assert time.monotonic() < deadline, jobs.get(b["id"])
        time.sleep(0.1)
    code = ("import sys; from mii_async.jobs.job_client import JobClient\n"
            "with JobClient(None, sys.argv[1]) as j: print(j.cancel(sys.argv[2])['status'])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), b["id"]], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() in ("cancelling", "cancelled"), out.stderr
    got = list(jobs.results(b["id"]))
    done = jobs.get(b["id"])
    assert done["status"] == "cancelled" and done["cancelling_at"], done
    counts = done["request_counts"]
    assert counts["total"] == 24 and counts["completed"] < 24 and counts["failed"] == 0
    assert len(got) == counts["completed"] == len({x["custom_id"] for x in got})
    jobs.close()


def _jsonl(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "hi", "max_tokens": 2}}) + "\n" for i in range(n)).encode()


def test_submit_refuses_past_the_limits_naming_them(tmp_path):
    """As the upload and batch routes refuse them: an input over max_file_bytes, one that would pass
    max_stored_bytes, more lines than max_lines — each a JobLimitError naming `lines` and the bound, with the
    routes' code and status, and nothing stored."""
    data = _jsonl(3)
    cases = [(JobLimits(max_file_bytes=len(data) - 1), "max_file_bytes", "file_too_large", 413),
             (JobLimits(max_stored_bytes=len(data) - 1), "max_stored_bytes", "storage_limit_exceeded", 413),
             (JobLimits(max_lines=2), "max_lines", "too_many_lines", 400)]
    for limits, bound, code, status in cases:
        with JobClient(None, str(tmp_path), limits) as jobs:
            with pytest.raises(JobLimitError) as e:
                jobs.submit(data, endpoint="/v1/completions")
            assert (e.value.param, e.value.limit, e.value.code, e.value.status) == ("lines", bound, code, status)
            assert bound in str(e.value)
    with JobClient(None, str(tmp_path), JobLimits(max_stored_bytes=2 * len(data) - 1)) as jobs:
        assert jobs.list() == []
        jobs.submit(data, endpoint="/v1/completions")          # what was stored counts toward the bound
        with pytest.raises(JobLimitError, match="max_stored_bytes"):
            jobs.submit(data, endpoint="/v1/completions")
        assert len(jobs.list()) == 1


def test_the_client_sweeps_before_it_takes_up_batches(client, tmp_path):
    """Taking the directory (no process held it), the client sweeps once before its runner takes up any batch,
    as a gateway does: a batch that passed its window while nothing ran it ends expired — its unanswered lines
    batch_expired in its error file — instead of running."""
    store = JobStore(str(tmp_path))
    f = store.add_file("in.jsonl", "batch", _jsonl(2))
    b = store.add_batch(f["id"], "/v1/completions", "24h", None, 0)        # its window ends as it is made
    store.start_batch(b["id"], [Line(i, f"c{i}", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
                                for i in range(2)])
    store.close()
    jobs = client.job_client(str(tmp_path))
    done = jobs.get(b["id"])
    assert jobs.runs_lines
    assert done["status"] == "expired" and done["expired_at"] is not None, done
    assert done["request_counts"] == {"total": 2, "completed": 0, "failed": 2} and done["error_file_id"]
    got = list(jobs.results(b["id"]))
    assert sorted(x["custom_id"] for x in got) == ["c0", "c1"]
    assert all(x["error"]["code"] == "batch_expired" for x in got)
    jobs.close()
