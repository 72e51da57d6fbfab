"""kill -9 of a whole deployment (router, worker, gateway) in the middle of a batch, then a new deployment on
the same jobs_dir: the batch resumes by itself, no finished line runs again, none is lost, and the output file
is whole, in input order, each answer the greedy answer of its line alone. Once with 40 lines of the default
model, once with 200 lines of a tiny random model (the issue's size, kept cheap)."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import mii_async
from tests.mesh_helpers import deployment_pids, wait_gone, with_word_tokenizer


def _serve(model_dir: Path, jobs_dir: str, **opts: Any):
    client = mii_async.serve(str(model_dir), enable_http=True, http_port=0, jobs_dir=jobs_dir, **opts)
    pids = [client._process.pid, client._process.gateway.pid] + deployment_pids(client.run(client.health()))
    return client, pids


def _finished(jobs_dir: str) -> dict[str, str]:
    """custom_id → the id of its committed result, read from the store as the killed gateway left it."""
    with sqlite3.connect(os.path.join(jobs_dir, "jobs.sqlite3")) as db:
        rows = db.execute("SELECT custom_id, result FROM lines WHERE result IS NOT NULL").fetchall()
    return {cid: json.loads(result)["id"] for cid, result in rows}


def _poll(http: httpx.Client, batch_id: str, done, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        b = http.get(f"/v1/batches/{batch_id}").json()
        if done(b):
            return b
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s; last: {b}"
        time.sleep(0.1)


def _kill_mid_batch_then_resume(model_dir: Path, jobs_dir: str, lines: list[dict], kill_after: int,
                                **opts: Any) -> None:
    """Runs `lines` as a batch, kills every process of the deployment (-9) once `kill_after` lines have
    finished, starts a new deployment on `jobs_dir` and checks the resumed batch's output file."""
    n = len(lines)
    client, pids = _serve(model_dir, jobs_dir, **opts)
    try:
        with httpx.Client(base_url=client.http_url, timeout=120) as http:
            f = http.post("/v1/files", files={"file": ("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines))},
                          data={"purpose": "batch"}).json()
            b = http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                               "completion_window": "24h"}).json()
            mid = _poll(http, b["id"], lambda b: b["request_counts"]["completed"] >= kill_after
                        or b["status"] not in ("in_progress", "validating"))
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert not wait_gone(pids, 30), "processes left after kill -9"
    finally:
        client.close()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert mid["status"] == "in_progress", mid
    before = _finished(jobs_dir)
    assert kill_after <= len(before) < n, f"{len(before)} lines had finished at the kill: not the middle of the batch"

    client, pids = _serve(model_dir, jobs_dir, **opts)
    try:
        with httpx.Client(base_url=client.http_url, timeout=120) as http:
            done = _poll(http, b["id"], lambda b: b["status"] in ("completed", "failed", "cancelled"))
            assert done["status"] == "completed", done
            assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}
            assert done["error_file_id"] is None
            out = [json.loads(x) for x in http.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()]
            assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]      # each once, in order
            for x in out:
                if x["custom_id"] in before:      # finished before the kill: its result kept, never rerun
                    assert x["id"] == before[x["custom_id"]], x["custom_id"]
            for line, x in zip(lines, out):
                alone = http.post("/v1/completions", json=line["body"]).json()
                assert x["response"]["status_code"] == 200
                assert x["response"]["body"]["choices"][0]["text"] == alone["choices"][0]["text"], x["custom_id"]
    finally:
        client.terminate_server_sync(drain_s=0)
        assert not wait_gone(pids), "processes left behind"


@pytest.mark.slow
def test_kill_9_mid_batch_then_restart_resumes(default_model_dir, tmp_path):
    """40 lines of the default model, killed after 8 have finished."""
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Here is fact number {i} about the sea:", "max_tokens": 24, "temperature": 0,
                       "ignore_eos": True}} for i in range(40)]
    _kill_mid_batch_then_resume(default_model_dir, str(tmp_path / "jobs"), lines, 8, kv_cache_memory=0.1)


@pytest.mark.slow
def test_kill_9_mid_200_line_batch_then_restart_resumes(tiny_model, tmp_path):
    """200 lines of a tiny random Llama (a word tokenizer: prompts of words w3 … w319), killed after 50 have
    finished: every custom_id once in the results, each the greedy answer of its line alone."""
    model = with_word_tokenizer(tiny_model("llama"), tmp_path / "tiny")
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"w{3 + i % 300} w{5 + (7 * i) % 300} w{11 + (13 * i) % 300}", "max_tokens": 16,
                       "temperature": 0, "ignore_eos": True}} for i in range(200)]
    _kill_mid_batch_then_resume(model, str(tmp_path / "jobs"), lines, 50, num_blocks=512)
