"""The Files and Batches API's limits and expiry (jobs/limits.py, jobs/expiry.py).

In process, on a real JobStore and BatchRunner: each batch line goes to `send`, which stands in for the
gateway's route (lines whose prompt is "fast" are answered at once, "slow" ones never, until cancelled), so that
a batch can be held in progress past its completion window. Then through a gateway process of the session's
deployment: the limits answered as 413/400 naming the bound, OpenAI's `expires_after` on upload, and the sweep
at a gateway's start deleting what expired while it was down.
"""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time

import httpx
import openai
import pytest

from mii_async.errors import InvalidParameterError
from mii_async.jobs.batch_input import parse_batch_input
from mii_async.jobs.batch_runner import BatchRunner
from mii_async.jobs.expiry import EXPIRED_LINE_ERROR, Expiry, upload_expires_after
from mii_async.jobs.limits import (JobLimitError, JobLimits, check_file_size, check_line_count, check_room,
                                   request_line_count)
from mii_async.jobs.openai_objects import batch_object, file_object
from mii_async.jobs.store import JobStore, Line

URL = "/v1/completions"
DAY = 24 * 3600
WAIT_S = 60


def _jsonl(prompts: list[str], url: str = URL, max_tokens: int = 4, **body) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                               "body": {"prompt": p, "max_tokens": max_tokens, **body}}) + "\n"
                   for i, p in enumerate(prompts)).encode()


def _accept(url: str, body: dict):
    return None


class Route:
    """Stands in for the gateway's route: "fast" prompts answered at once, "slow" ones held until cancelled."""

    def __init__(self) -> None:
        self.sent = 0
        self.cancelled = 0

    async def __call__(self, url: str, body: dict) -> tuple[int, dict]:
        self.sent += 1
        if body["prompt"] == "fast":
            return 200, {"id": f"cmpl-{self.sent}", "choices": [{"text": "ok"}]}
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")


async def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {WAIT_S} s"
        await asyncio.sleep(0.01)


def test_job_limits_name_the_bound():
    """A bad JobLimits value names its field; each check refuses past its bound with the status, code and the
    bound's name; the line count is the one batch validation uses (blank lines not counted)."""
    with pytest.raises(InvalidParameterError, match="max_stored_bytes"):
        JobLimits(max_stored_bytes=0)
    with pytest.raises(InvalidParameterError, match="sweep_interval_s"):
        JobLimits(sweep_interval_s=float("inf"))
    limits = JobLimits(max_file_bytes=100, max_lines=2, max_stored_bytes=1000)
    check_file_size(limits, 100)
    with pytest.raises(JobLimitError, match="max_file_bytes is 100") as e:
        check_file_size(limits, 101)
    assert (e.value.status, e.value.code, e.value.param, e.value.limit) == (413, "file_too_large", "file",
                                                                             "max_file_bytes")
    check_room(limits, 900, 100)
    with pytest.raises(JobLimitError, match=r"max_stored_bytes \(1000\)") as e:
        check_room(limits, 901, 100)
    assert (e.value.status, e.value.code) == (413, "storage_limit_exceeded")
    data = _jsonl(["a", "b"]) + b"\n  \n" + _jsonl(["c"]).replace(b"c0", b"c9")
    assert request_line_count(data) == 3
    assert len(parse_batch_input(data, URL, _accept, 10)[0]) == 3
    check_line_count(limits, 2)
    with pytest.raises(JobLimitError, match="max_lines is 2") as e:
        check_line_count(limits, request_line_count(data))
    assert (e.value.status, e.value.code, e.value.param) == (400, "too_many_lines", "input_file_id")


def _multipart(**fields: str) -> tuple[str, bytes]:
    req = httpx.Request("POST", "http://x/v1/files", data={"purpose": "batch", **fields},
                        files={"file": ("in.jsonl", b"{}\n")})
    return req.headers["content-type"], req.read()


def test_expires_after_is_read_from_the_upload_form():
    """expires_after[anchor]/[seconds] (the openai package's form) or one JSON field; none: None; a wrong anchor,
    seconds outside OpenAI's 3600..30 days, or an unknown key is refused naming it."""
    assert upload_expires_after(*_multipart()) is None
    assert upload_expires_after(*_multipart(**{"expires_after[anchor]": "created_at",
                                               "expires_after[seconds]": "7200"})) == 7200
    assert upload_expires_after(*_multipart(expires_after='{"anchor": "created_at", "seconds": 3600}')) == 3600
    for fields, param in (({"expires_after[anchor]": "last_used", "expires_after[seconds]": "7200"},
                           "expires_after.anchor"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
                           "expires_after.seconds"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": str(31 * DAY)},
                           "expires_after.seconds"),
                          ({"expires_after[anchor]": "created_at"}, "expires_after.seconds"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "7200",
                            "expires_after[days]": "1"}, "expires_after.days")):
        with pytest.raises(InvalidParameterError) as e:
            upload_expires_after(*_multipart(**fields))
        assert e.value.param == param, fields


def test_a_batch_past_its_window_expires_keeping_its_answered_lines(tmp_path):
    """A batch still in progress at its expires_at: its lines in flight are aborted and it ends `expired`, its
    answered lines in the output file, every unanswered one in the error file as batch_expired (counted failed),
    which its Batch object names with its expired_at, and the runner does not take it up again. A retention
    later the batch, its lines and its three files are deleted, rows and bytes."""
    async def run() -> None:
        store = JobStore(str(tmp_path))
        limits = JobLimits()
        route = Route()
        runner = BatchRunner(store, route, _accept, limits)
        expiry = Expiry(store, runner, limits)
        f = store.add_file("in.jsonl", "batch", _jsonl(["fast", "slow", "fast", "slow", "slow"]))
        b = store.add_batch(f["id"], URL, "24h", None, DAY)
        runner.start()                                   # takes up the validating batch
        try:
            await _until(lambda: store.get_batch(b["id"])["completed"] == 2 and route.sent == 5,
                         "two answered and three lines in flight")
            assert (await expiry.sweep(now=b["expires_at"] - 1)).expired_batches == []
            assert store.get_batch(b["id"])["status"] == "in_progress"

            swept = await expiry.sweep(now=b["expires_at"])
            assert swept.expired_batches == [b["id"]] and route.cancelled == 3
            done = store.get_batch(b["id"])
            assert (done["status"], done["total"], done["completed"], done["failed"]) == ("expired", 5, 2, 3)
            assert done["expired_at"] is not None
            out = [json.loads(x) for x in store.read_file(done["output_file_id"]).splitlines()]
            err = [json.loads(x) for x in store.read_file(done["error_file_id"]).splitlines()]
            assert [x["custom_id"] for x in out] == ["c0", "c2"]
            assert [x["custom_id"] for x in err] == ["c1", "c3", "c4"]
            assert all(x["response"] is None and x["error"] == EXPIRED_LINE_ERROR for x in err)
            shown = batch_object(done)
            assert (shown["output_file_id"], shown["error_file_id"]) == (done["output_file_id"], done["error_file_id"])
            assert shown["expired_at"] == done["expired_at"] and shown["request_counts"]["failed"] == 3
            runner.poll_once()
            assert route.sent == 5 and store.get_batch(b["id"])["status"] == "expired"

            kept = await expiry.sweep(now=f["created_at"] + limits.retention_s - 1)
            assert kept.deleted_batches == [] and kept.deleted_files == []
            gone = await expiry.sweep(now=int(time.time()) + limits.retention_s)
            assert gone.deleted_batches == [b["id"]]
            assert set(gone.deleted_files) == {f["id"], done["output_file_id"], done["error_file_id"]}
            assert store.get_batch(b["id"]) is None and store.list_files() == []
            assert os.listdir(store.files_dir) == []
            assert expiry.deleted_lines == {"completed": 2, "failed": 3}
        finally:
            await expiry.close()
            await runner.close()
            store.close()

    asyncio.run(run())


def test_files_expire_at_their_own_time_or_after_the_retention(tmp_path):
    """A file with its own expiry goes at that time, one without at created_at + retention_s, as its File object
    says; the input file of a batch still validating stays until the batch has read it; a file deleted leaves
    no expiry row behind."""
    async def run() -> None:
        store = JobStore(str(tmp_path))
        limits = JobLimits(retention_s=10 * DAY)
        expiry = Expiry(store, BatchRunner(store, Route(), _accept, limits), limits)
        own = store.add_file("own.jsonl", "batch", b"x\n", expires_after_s=3600)
        default = store.add_file("default.jsonl", "batch", b"y\n")
        held = store.add_file("held.jsonl", "batch", b"z\n")
        store.add_batch(held["id"], URL, "24h", None, 20 * DAY)     # validating: no runner started here
        assert expiry.file_expires_at(store.get_file(own["id"])) == own["created_at"] + 3600
        assert file_object(default, expiry.file_expires_at(default))["expires_at"] == default["created_at"] + 10 * DAY
        assert (await expiry.sweep(now=own["created_at"] + 3599)).deleted_files == []
        assert (await expiry.sweep(now=own["created_at"] + 3600)).deleted_files == [own["id"]]
        assert not os.path.exists(store.file_path(own["id"])) and store.get_file(default["id"]) is not None
        assert (await expiry.sweep(now=default["created_at"] + 10 * DAY)).deleted_files == [default["id"]]
        assert store.get_file(held["id"]) is not None and os.path.exists(store.file_path(held["id"]))
        with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
            assert db.execute("SELECT COUNT(*) FROM file_expiry").fetchone()[0] == 0
        store.close()

    asyncio.run(run())


def test_an_expiry_cut_short_is_finished_at_the_next_opening(tmp_path):
    """A process killed between moving a batch to expired and writing its files: the sweep at the next opening
    answers its lines as batch_expired and writes its files; an answered line is kept."""
    store = JobStore(str(tmp_path))
    limits = JobLimits()
    f = store.add_file("in.jsonl", "batch", _jsonl(["fast", "slow"]))
    b = store.add_batch(f["id"], URL, "24h", None, DAY)
    store.start_batch(b["id"], [Line(0, "c0", URL, {"prompt": "fast"}), Line(1, "c1", URL, {"prompt": "slow"})])
    store.finish_line(b["id"], 0, {"custom_id": "c0", "response": {"status_code": 200}, "error": None}, ok=True)
    expiry = Expiry(store, BatchRunner(store, Route(), _accept, limits), limits)
    assert expiry._begin_expiry(b["id"])
    store.choose_output_ids(b["id"])                       # then the process dies, its files unwritten
    shown = batch_object(store.get_batch(b["id"]))
    assert shown["status"] == "expired" and shown["output_file_id"] is None and shown["expired_at"] is None
    store.close()

    store = JobStore(str(tmp_path))
    expiry = Expiry(store, BatchRunner(store, Route(), _accept, limits), limits)
    assert expiry.sweep_before_start().expired_batches == []   # already expired: only finished here
    done = store.get_batch(b["id"])
    assert (done["status"], done["completed"], done["failed"]) == ("expired", 1, 1) and done["expired_at"]
    assert batch_object(done)["output_file_id"] == done["output_file_id"]
    assert [json.loads(x)["custom_id"] for x in store.read_file(done["output_file_id"]).splitlines()] == ["c0"]
    [err] = [json.loads(x) for x in store.read_file(done["error_file_id"]).splitlines()]
    assert err["custom_id"] == "c1" and err["error"]["code"] == "batch_expired"
    store.close()


# ------------------------------------------------------------------ through a gateway process


THREE = _jsonl(["a", "b", "c"])


@pytest.fixture(scope="module")
def limited(start_gateway, tmp_path_factory):
    jobs_dir = tmp_path_factory.mktemp("jobs-limited")
    return start_gateway(jobs_dir=str(jobs_dir), jobs_max_file_bytes=len(THREE) + 50, jobs_max_lines=2,
                         jobs_max_stored_bytes=3 * len(THREE) + len(THREE) // 2)


def test_gateway_refuses_past_its_limits_naming_them(limited):
    """Through the openai package: a file over jobs_max_file_bytes is a 413 naming max_file_bytes, a batch of more
    lines than jobs_max_lines a 400 naming max_lines, an upload that would pass jobs_max_stored_bytes a 413 naming
    it (room comes back when a file is deleted), and a bad expires_after a 400 naming the field."""
    with openai.OpenAI(base_url=f"{limited.url}/v1", api_key="unused", max_retries=0, timeout=60) as oai:
        with pytest.raises(openai.APIStatusError) as e:
            oai.files.create(file=("big.jsonl", b"x" * (len(THREE) + 51)), purpose="batch")
        assert e.value.status_code == 413 and "max_file_bytes" in e.value.message
        assert e.value.body["code"] == "file_too_large" and e.value.body["param"] == "file"

        three = THREE
        f = oai.files.create(file=("three.jsonl", three), purpose="batch")
        with pytest.raises(openai.BadRequestError) as e:
            oai.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h")
        assert "max_lines" in e.value.message and e.value.body["param"] == "input_file_id"
        assert e.value.body["code"] == "too_many_lines"
        assert oai.batches.list().data == []

        kept = [f, oai.files.create(file=("b.jsonl", three), purpose="batch"),
                oai.files.create(file=("c.jsonl", three), purpose="batch")]
        with pytest.raises(openai.APIStatusError) as e:
            oai.files.create(file=("d.jsonl", three), purpose="batch")
        assert e.value.status_code == 413 and "max_stored_bytes" in e.value.message
        assert e.value.body["code"] == "storage_limit_exceeded"
        oai.files.delete(kept[0].id)
        oai.files.create(file=("d.jsonl", three), purpose="batch")

        for bad, param in (({"anchor": "created_at", "seconds": 59}, "expires_after.seconds"),
                           ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor")):
            with pytest.raises(openai.BadRequestError) as e:
                oai.files.create(file=("e.jsonl", b"{}\n"), purpose="batch", expires_after=bad)
            assert e.value.body["param"] == param


def _wait_status(oai, batch_id: str, until: tuple[str, ...]):
    deadline = time.monotonic() + 300
    while (b := oai.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status}"
        time.sleep(0.2)
    return b


def test_gateway_sweeps_at_start_what_expired_while_it_was_down(start_gateway, deployment, tmp_path):
    """A gateway stopped with a batch in progress; meanwhile (the clock moved in its database) the batch passed
    its window, a file uploaded with expires_after passed it and an ended batch passed the retention. The
    restarted gateway expires the running batch (answered lines kept, the rest batch_expired; its Batch object
    names both files and its expired_at) instead of resuming it, and deletes the expired file and the old batch
    with its files, rows and bytes. Each File object gives its expires_at."""
    jobs_dir = str(tmp_path / "jobs")
    limits = deployment.run(deployment.health())["limits"]
    long = min(limits["max_model_len"], limits["max_request_tokens"]) - 16    # minutes of decoding on the CPU
    gw = start_gateway(jobs_dir=jobs_dir)
    with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120) as oai:
        model = oai.models.list().data[0].id
        short = oai.files.create(file=("short.jsonl", _jsonl(["Hello"], model=model)), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": 3600})
        assert short.expires_at == short.created_at + 3600
        old = _wait_status(oai, oai.batches.create(input_file_id=short.id, endpoint=URL,
                                                   completion_window="24h").id, ("completed",))
        # two lines answered at once, two that would run for minutes (ignore_eos): in flight at the stop
        lines = [{"custom_id": f"q{i}", "method": "POST", "url": URL,
                  "body": {"model": model, "prompt": "Once upon a time", "max_tokens": n, "ignore_eos": True,
                           "temperature": 0}} for i, n in enumerate((1, long, 1, long))]
        running = oai.files.create(file=("running.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                   purpose="batch")
        b = oai.batches.create(input_file_id=running.id, endpoint=URL, completion_window="24h")
        deadline = time.monotonic() + 300
        while (cur := oai.batches.retrieve(b.id)).request_counts.completed < 2:
            assert cur.status in ("validating", "in_progress") and time.monotonic() < deadline, cur
            time.sleep(0.2)
    gw.stop()

    now = int(time.time())
    with sqlite3.connect(os.path.join(jobs_dir, "jobs.sqlite3")) as db:
        db.execute("UPDATE batches SET expires_at = ? WHERE id = ?", (now - 1, b.id))
        db.execute("UPDATE batches SET created_at = ? WHERE id = ?", (now - 31 * DAY, old.id))
        db.execute("UPDATE files SET created_at = ? WHERE id = ?", (now - 31 * DAY, old.output_file_id))
        db.execute("UPDATE file_expiry SET expires_at = ? WHERE file_id = ?", (now - 1, short.id))
    gw = start_gateway(jobs_dir=jobs_dir)
    with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120) as oai:
        done = oai.batches.retrieve(b.id)
        assert done.status == "expired" and done.expired_at is not None, done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 2, 2)
        files = {f.filename: f.id for f in oai.files.list()}
        assert done.output_file_id == files[f"{b.id}_output.jsonl"]
        assert done.error_file_id == files[f"{b.id}_error.jsonl"]
        out = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
        err = [json.loads(x) for x in oai.files.content(done.error_file_id).text.splitlines()]
        assert [x["custom_id"] for x in out] == ["q0", "q2"] and [x["custom_id"] for x in err] == ["q1", "q3"]
        assert all(x["error"]["code"] == "batch_expired" for x in err)
        for gone in (short.id, old.output_file_id):
            with pytest.raises(openai.NotFoundError):
                oai.files.retrieve(gone)
            assert not os.path.exists(os.path.join(jobs_dir, "files", gone))
        with pytest.raises(openai.NotFoundError):
            oai.batches.retrieve(old.id)
        assert running.id in files.values()            # within its retention
        assert oai.files.retrieve(running.id).expires_at == running.created_at + 30 * DAY
    gw.stop()
