"""The Files and Batches API in /metrics (jobs/stats.py, gateway/metrics.py): batches by status, lines by state,
the finished-lines counter and stored bytes — first from a real JobStore in process, then from a gateway process
of the session's deployment running real batches."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from mii_async.gateway.metrics import Metrics
from mii_async.jobs.batch_runner import BatchRunner
from mii_async.jobs.expiry import Expiry
from mii_async.jobs.limits import JobLimits
from mii_async.jobs.stats import BATCH_STATUSES, JobStats
from mii_async.jobs.store import JobStore, Line

URL = "/v1/completions"
DAY = 24 * 3600


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Each sample of a scrape: (name, sorted labels) → value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _jobs(samples: dict) -> dict[str, float]:
    """The jobs families as `name{label}` → value."""
    out = {}
    for (name, labels), v in samples.items():
        if name.startswith(("mii_async_batch", "mii_async_jobs")):
            out[name + "".join(f"{{{val}}}" for _, val in labels)] = v
    return out


def _ended_batch(store: JobStore, answers: list[bool]) -> dict:
    f = store.add_file("in.jsonl", "batch", b"x\n" * len(answers))
    b = store.add_batch(f["id"], URL, "24h", None, DAY)
    store.start_batch(b["id"], [Line(i, f"c{i}", URL, {}) for i in range(len(answers))])
    for i, ok in enumerate(answers):
        store.finish_line(b["id"], i, {"custom_id": f"c{i}"}, ok=ok)
    store.choose_output_ids(b["id"])
    return store.finish_batch(b["id"], "completed", "completed_at")


async def _never(url: str, body: dict) -> tuple[int, dict]:
    raise AssertionError("no line runs in this test")


def test_job_stats_from_the_store(tmp_path):
    """Gauges read the store; the finished counter starts at 0 with the process, grows with lines answered after,
    and stays put when the expiry sweep deletes a batch (while the gauges drop)."""
    async def run() -> None:
        store = JobStore(str(tmp_path))
        limits = JobLimits(max_stored_bytes=10_000)
        runner = BatchRunner(store, _never, lambda u, b: None, limits)
        expiry = Expiry(store, runner, limits)
        before = _ended_batch(store, [True, False])
        stats = JobStats(store, runner, expiry, limits)
        metrics = Metrics()
        metrics.jobs.source = stats.read

        got = _jobs(_samples(metrics.render().decode()))
        assert got["mii_async_batches{completed}"] == 1 and got["mii_async_batches{in_progress}"] == 0
        assert {s for s in BATCH_STATUSES} == {k[len("mii_async_batches{"):-1] for k in got
                                               if k.startswith("mii_async_batches{")}
        assert (got["mii_async_batch_lines{completed}"], got["mii_async_batch_lines{failed}"]) == (1, 1)
        assert got["mii_async_batch_lines_finished_total{completed}"] == 0       # answered before this process
        assert got["mii_async_jobs_files"] == 3 and got["mii_async_jobs_max_stored_bytes"] == 10_000
        assert got["mii_async_jobs_stored_bytes"] == sum(f["bytes"] for f in store.list_files())

        f = store.add_file("in2.jsonl", "batch", b"y\n" * 3)
        b = store.add_batch(f["id"], URL, "24h", None, 40 * DAY)        # not overdue at the sweep below
        store.start_batch(b["id"], [Line(i, f"d{i}", URL, {}) for i in range(3)])
        store.finish_line(b["id"], 0, {"custom_id": "d0"}, ok=True)
        c = stats.read()
        assert c.batches["in_progress"] == 1 and c.lines["queued"] == 2 and c.lines["running"] == 0
        assert c.finished == {"completed": 1, "failed": 0}

        swept = await expiry.sweep(now=before["created_at"] + limits.retention_s)
        assert before["id"] in swept.deleted_batches
        c = stats.read()
        assert c.finished == {"completed": 1, "failed": 0}                      # not taken down by the delete
        assert (c.lines["completed"], c.lines["failed"], c.batches["completed"]) == (1, 0, 0)
        store.finish_line(b["id"], 1, {"custom_id": "d1"}, ok=False)
        assert stats.read().finished == {"completed": 1, "failed": 1}
        await expiry.close()
        store.close()

    asyncio.run(run())


def _scrape(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", timeout=60)
    assert r.status_code == 200
    return _jobs(_samples(r.text))


def test_gateway_metrics_follow_real_batches(start_gateway, deployment, tmp_path):
    """A gateway whose jobs_dir holds no store reports zeros (and creates none). A 3-line batch run to the end:
    1 completed batch, 3 lines finished, stored bytes = its files'. A batch of long lines: some running (at most
    max_in_flight), the rest queued, summing to its unanswered lines; cancelled: none queued or running."""
    jobs_dir = tmp_path / "jobs"
    gw = start_gateway(jobs_dir=str(jobs_dir))
    got = _scrape(gw.url)
    assert got["mii_async_batches{completed}"] == 0 and got["mii_async_jobs_stored_bytes"] == 0
    assert got["mii_async_batch_lines_finished_total{completed}"] == 0 and not jobs_dir.exists()

    with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120) as oai:
        model = oai.models.list().data[0].id
        lines = [{"custom_id": f"q{i}", "method": "POST", "url": URL,
                  "body": {"model": model, "prompt": p, "max_tokens": 4, "temperature": 0}}
                 for i, p in enumerate(["One", "Two", "Three"])]
        f = oai.files.create(file=("q.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                             purpose="batch")
        b = oai.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h")
        deadline = time.monotonic() + 300
        while (b := oai.batches.retrieve(b.id)).status != "completed":
            assert b.status in ("validating", "in_progress", "finalizing") and time.monotonic() < deadline, b
            time.sleep(0.2)
        got = _scrape(gw.url)
        assert got["mii_async_batches{completed}"] == 1 and got["mii_async_batch_lines{completed}"] == 3
        assert got["mii_async_batch_lines_finished_total{completed}"] == 3
        assert got["mii_async_jobs_files"] == 2
        assert got["mii_async_jobs_stored_bytes"] == f.bytes + oai.files.retrieve(b.output_file_id).bytes

        limits = deployment.run(deployment.health())["limits"]
        long = min(limits["max_model_len"], limits["max_request_tokens"]) - 16
        slow = [{"custom_id": f"s{i}", "method": "POST", "url": URL,
                 "body": {"model": model, "prompt": "Once upon a time", "max_tokens": long, "ignore_eos": True}}
                for i in range(12)]
        f2 = oai.files.create(file=("s.jsonl", "".join(json.dumps(x) + "\n" for x in slow).encode()),
                              purpose="batch")
        b2 = oai.batches.create(input_file_id=f2.id, endpoint=URL, completion_window="24h")
        deadline = time.monotonic() + 120
        while (got := _scrape(gw.url))["mii_async_batch_lines{running}"] == 0:
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        max_in_flight = 8                                              # JobLimits' default
        assert got["mii_async_batches{in_progress}"] == 1
        assert 1 <= got["mii_async_batch_lines{running}"] <= max_in_flight
        assert got["mii_async_batch_lines{queued}"] + got["mii_async_batch_lines{running}"] == 12
        oai.batches.cancel(b2.id)
        deadline = time.monotonic() + 120
        while oai.batches.retrieve(b2.id).status != "cancelled":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        got = _scrape(gw.url)
        assert got["mii_async_batches{cancelled}"] == 1 and got["mii_async_batches{in_progress}"] == 0
        assert got["mii_async_batch_lines{queued}"] == 0 and got["mii_async_batch_lines{running}"] == 0
    gw.stop()
