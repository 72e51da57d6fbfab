"""The Batch API's options where a deployment starts: `serve(enable_http=True, jobs_dir=…, jobs_max_*=…)` gives
them to its gateway and to the returned client's `jobs`; the job-limit flags of `serve`, `gateway` and `batch`
reach HttpConfig, a bad value named before anything starts."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

import mii_async
from mii_async.jobs import JobLimitError
from tests.mesh_helpers import deployment_pids, wait_gone


def _lines(n: int) -> list[dict]:
    return [{"custom_id": f"c{i}", "body": {"prompt": f"Number {i} is", "max_tokens": 4, "temperature": 0}}
            for i in range(n)]


def _jsonl(n: int) -> bytes:
    return "".join(json.dumps({**x, "method": "POST", "url": "/v1/completions"}) + "\n" for x in _lines(n)).encode()


def test_serve_gives_its_jobs_dir_and_limits_to_client_jobs(default_model_dir, tmp_path):
    """The client serve() returns works on its gateway's jobs_dir by default, with its limits: the batch route
    and client.jobs.submit refuse the same input naming max_lines, and a batch within them that client.jobs
    submits runs in the gateway (which holds the directory)."""
    jobs_dir = str(tmp_path / "jobs")
    c = mii_async.serve(str(default_model_dir), kv_cache_memory=0.1, enable_http=True, http_port=0,
                        jobs_dir=jobs_dir, jobs_max_lines=2)
    pids = [c._process.pid] + deployment_pids(c.run(c.health()))
    try:
        with httpx.Client(base_url=c.http_url, timeout=120) as http:
            f = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", _jsonl(3))}).json()
            r = http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                               "completion_window": "24h"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_lines", r.text
        assert c.jobs.jobs_dir == jobs_dir
        with pytest.raises(JobLimitError) as e:
            c.jobs.submit(_lines(3), endpoint="/v1/completions")
        assert e.value.limit == "max_lines" and e.value.code == "too_many_lines" and "max_lines is 2" in str(e.value)
        b = c.jobs.submit(_lines(2), endpoint="/v1/completions")
        got = list(c.jobs.results(b["id"]))
        assert not c.jobs.runs_lines and sorted(x["custom_id"] for x in got) == ["c0", "c1"]
        assert all(x["response"]["status_code"] == 200 for x in got)
    finally:
        c.terminate_server_sync(drain_s=0)
    assert not wait_gone(pids), "processes left behind"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mii_async", *args], capture_output=True, text=True, timeout=300)


def test_a_bad_job_limit_flag_is_named_before_anything_starts(tmp_path):
    """serve, gateway and batch each refuse a job limit that is not a positive integer, exit 2 naming its
    HttpConfig field, before a model loads or a router is asked."""
    for args, field in ((("serve", "--port", "0", "--jobs-max-file-bytes", "0"), "jobs_max_file_bytes"),
                        (("gateway", "--router", "tcp://127.0.0.1:9", "--jobs-retention-s", "-1"), "jobs_retention_s"),
                        (("batch", "list", "--jobs-dir", str(tmp_path), "--jobs-max-stored-bytes", "0"),
                         "jobs_max_stored_bytes")):
        out = _cli(*args)
        assert out.returncode == 2 and field in out.stderr and "loading" not in out.stderr, (args, out.stderr)


def test_the_batch_commands_limits_apply_to_its_submit(deployment, tmp_path):
    """`mii-async batch submit --jobs-max-lines 2` through a router refuses a 3-line file naming max_lines and
    stores nothing."""
    (tmp_path / "in.jsonl").write_bytes(_jsonl(3))
    jobs_dir = str(tmp_path / "jobs")
    out = _cli("batch", "submit", str(tmp_path / "in.jsonl"), "--endpoint", "/v1/completions", "--target",
               deployment.address, "--jobs-dir", jobs_dir, "--jobs-max-lines", "2")
    assert out.returncode == 2 and "max_lines is 2" in out.stderr and out.stdout == "", out.stderr
    ls = _cli("batch", "list", "--jobs-dir", jobs_dir)
    assert ls.returncode == 0 and len(ls.stdout.splitlines()) == 1, ls.stdout       # the header alone
