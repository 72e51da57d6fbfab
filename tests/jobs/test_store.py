"""JobStore and the batch input check, without a deployment: durability rules and validation per line."""
from __future__ import annotations

import json
import sqlite3

import pytest

from mii_async.errors import UnavailableError
from mii_async.jobs.batch_input import parse_batch_input
from mii_async.jobs.store import JobStore, Line

URL = "/v1/completions"


def _line(cid: str, url: str = URL, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"prompt": "hi", **body}})


def _no_refusal(url: str, body: dict):
    return ("stream", "no streams") if body.get("stream") else None


def test_one_gateway_per_jobs_dir(tmp_path):
    """A second store on a directory another holds is refused, naming jobs_dir; closing frees it."""
    a = JobStore(str(tmp_path))
    with pytest.raises(UnavailableError, match="jobs_dir"):
        JobStore(str(tmp_path))
    a.close()
    JobStore(str(tmp_path)).close()


def test_finished_line_is_never_overwritten_and_files_keep_input_order(tmp_path):
    """finish_line counts a line once (a second result for it is ignored); the output and error files list the
    lines in input order, 2xx answers in one and the rest in the other; an unfinished batch survives a reopen."""
    s = JobStore(str(tmp_path))
    f = s.add_file("in.jsonl", "batch", b"x\n")
    b = s.add_batch(f["id"], URL, "24h", {"k": "v"}, 3600)
    s.start_batch(b["id"], [Line(i, f"c{i}", URL, {"prompt": str(i)}) for i in range(4)])
    for i in (3, 1, 0):
        s.finish_line(b["id"], i, {"custom_id": f"c{i}", "n": i}, ok=i != 1)
    s.finish_line(b["id"], 0, {"custom_id": "c0", "n": "again"}, ok=False)
    s.close()
    s = JobStore(str(tmp_path))
    assert [x["id"] for x in s.active_batches()] == [b["id"]]
    assert [ln.custom_id for ln in s.pending_lines(b["id"])] == ["c2"]
    s.finish_line(b["id"], 2, {"custom_id": "c2", "n": 2}, ok=True)
    s.choose_output_ids(b["id"])
    done = s.finish_batch(b["id"], "completed", "completed_at")
    assert (done["status"], done["total"], done["completed"], done["failed"]) == ("completed", 4, 3, 1)
    out = [json.loads(x) for x in s.read_file(done["output_file_id"]).splitlines()]
    err = [json.loads(x) for x in s.read_file(done["error_file_id"]).splitlines()]
    assert [x["n"] for x in out] == [0, 2, 3] and [x["n"] for x in err] == [1]
    assert s.active_batches() == []
    s.close()
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_file_without_errors_gets_no_error_file(tmp_path):
    """A batch whose lines all succeeded has no error file (error_file_id null), as OpenAI's."""
    s = JobStore(str(tmp_path))
    b = s.add_batch(s.add_file("in.jsonl", "batch", b"x")["id"], URL, "24h", None, 3600)
    s.start_batch(b["id"], [Line(0, "a", URL, {})])
    s.finish_line(b["id"], 0, {"custom_id": "a"}, ok=True)
    s.choose_output_ids(b["id"])
    done = s.finish_batch(b["id"], "completed", "completed_at")
    assert done["output_file_id"] and done["error_file_id"] is None
    assert {f["purpose"] for f in s.list_files()} == {"batch", "batch_output"}
    s.close()


def test_every_bad_line_is_reported_with_its_line_number():
    """Malformed JSON, a missing or duplicate custom_id, a wrong method or url, a body that is no object and a
    body the route refuses each fail validation, with 1-based line numbers and the parameter named."""
    data = "\n".join([
        _line("a"),
        "{not json",
        _line("a"),
        json.dumps({"method": "POST", "url": URL, "body": {}}),
        json.dumps({"custom_id": "m", "method": "GET", "url": URL, "body": {}}),
        _line("u", url="/v1/embeddings"),
        json.dumps({"custom_id": "b", "method": "POST", "url": URL, "body": [1]}),
        _line("s", stream=True),
        "",
        _line("ok"),
    ]).encode()
    lines, errors = parse_batch_input(data, URL, _no_refusal, max_lines=100)
    got = [(e["line"], e["code"], e["param"]) for e in errors]
    assert got == [(2, "invalid_json_line", None), (3, "duplicate_custom_id", "custom_id"),
                   (4, "invalid_request", "custom_id"), (5, "invalid_request", "method"),
                   (6, "invalid_url", "url"), (7, "invalid_request", "body"),
                   (8, "invalid_request", "body.stream")]
    assert [ln.custom_id for ln in lines] == ["a", "ok"] and [ln.idx for ln in lines] == [0, 1]


def test_limits_on_lines_and_empty_files():
    """More lines than max_lines, an empty file and a file that is not UTF-8 fail with one error each."""
    many = "\n".join(_line(f"c{i}") for i in range(4)).encode()
    assert parse_batch_input(many, URL, _no_refusal, 3)[1][0]["code"] == "too_many_lines"
    assert parse_batch_input(many, URL, _no_refusal, 4)[1] == []
    assert parse_batch_input(b"\n \n", URL, _no_refusal, 4)[1][0]["code"] == "empty_file"
    assert parse_batch_input(b"\xff\xfe", URL, _no_refusal, 4)[1][0]["code"] == "invalid_file"


def test_a_lone_surrogate_fails_its_line():
    """A line holding a string that is not Unicode text ("\\ud800" is legal JSON) fails validation naming where."""
    bad = '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\\ud800"}}'
    [err] = parse_batch_input(bad.encode(), URL, _no_refusal, 4)[1]
    assert err["line"] == 1 and "prompt" in err["param"], err


def test_a_store_made_without_the_later_columns_gets_them(tmp_path):
    """A database lacking lines.done_seq, batches.expired_at and the file_expiry table (an earlier version's)
    opens with them added, its rows kept: results() gives its finished lines, a batch shows no expired_at, and
    an upload's own expiry is kept."""
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        db.executescript("""
            CREATE TABLE files (id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL,
                                bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
            CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,
                input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL, completion_window TEXT NOT NULL, metadata TEXT,
                status TEXT NOT NULL, errors TEXT, created_at INTEGER NOT NULL, in_progress_at INTEGER,
                finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, cancelling_at INTEGER,
                cancelled_at INTEGER, expires_at INTEGER NOT NULL, output_file_id TEXT, error_file_id TEXT,
                total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0,
                failed INTEGER NOT NULL DEFAULT 0);
            CREATE TABLE lines (batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL,
                url TEXT NOT NULL, body TEXT NOT NULL, result TEXT, ok INTEGER, PRIMARY KEY (batch_id, idx))
                WITHOUT ROWID;
            INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, created_at, expires_at,
                                 total, completed) VALUES ('batch_old', 'file-x', '/v1/completions', '24h',
                                 'in_progress', 1, 86401, 2, 1);
            INSERT INTO lines VALUES ('batch_old', 0, 'a', '/v1/completions', '{}', '{"custom_id": "a"}', 1);
            INSERT INTO lines VALUES ('batch_old', 1, 'b', '/v1/completions', '{}', NULL, NULL);
        """)
    s = JobStore(str(tmp_path))
    assert s.get_batch("batch_old")["expired_at"] is None
    assert s.results_since("batch_old", -1) == [(0, {"custom_id": "a"})]
    s.finish_line("batch_old", 1, {"custom_id": "b"}, ok=True)
    assert s.results_since("batch_old", 0) == [(1, {"custom_id": "b"})]
    f = s.add_file("in.jsonl", "batch", b"x\n", expires_after_s=3600)
    assert f["expires_at"] == f["created_at"] + 3600 and s.get_file(f["id"])["expires_at"] == f["expires_at"]
    assert s.delete_file(f["id"]) and s.get_file(f["id"]) is None
    s.close()
