"""`mii-async batch` (jobs/batch_cli.py) end to end, run as a subprocess: over a real gateway's HTTP API, and
through the Python API on the session's router (the command then runs the lines itself); the progress line."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import httpx
import pytest

from mii_async.jobs.batch_cli import ProgressLine


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mii_async", "batch", *args], capture_output=True, text=True,
                          timeout=300)


def _requests(path, n: int = 4) -> list[dict]:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Fact {i} about the moon:", "max_tokens": 6, "temperature": 0}} for i in range(n)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def test_the_command_over_a_gateways_http_api(start_gateway, tmp_path):
    """submit --wait prints the id and a progress line per change (not a terminal), exits 0 once completed;
    status prints the Batch object; results -o writes the output lines, each the gateway's greedy answer to its
    body; list shows the batch; cancelling an ended batch fails naming the gateway's 409; a file with a bad
    line ends failed (exit 1) with the line's error printed."""
    gw = start_gateway(jobs_dir=str(tmp_path / "jobs"))
    lines = _requests(tmp_path / "in.jsonl")
    p = _cli("submit", str(tmp_path / "in.jsonl"), "--endpoint", "/v1/completions", "--target", gw.url, "--wait")
    assert p.returncode == 0, p.stderr
    batch_id = p.stdout.strip()
    progress = [x for x in p.stderr.splitlines() if x.startswith(batch_id)]
    assert progress and "\r" not in p.stderr and progress[-1].endswith("4/4 (0 failed) completed"), p.stderr
    st = _cli("status", batch_id, "--target", gw.url)
    assert st.returncode == 0 and json.loads(st.stdout)["request_counts"]["completed"] == 4, st.stderr
    out = tmp_path / "out.jsonl"
    r = _cli("results", batch_id, "--target", gw.url, "-o", str(out))
    assert r.returncode == 0 and "4 lines written" in r.stderr, r.stderr
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in got] == [x["custom_id"] for x in lines]
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        for line, x in zip(lines, got):
            alone = http.post("/v1/completions", json=line["body"]).json()
            assert x["response"]["body"]["choices"][0]["text"] == alone["choices"][0]["text"]
    ls = _cli("list", "--target", gw.url)
    assert ls.returncode == 0 and batch_id in ls.stdout and "completed" in ls.stdout
    c = _cli("cancel", batch_id, "--target", gw.url)
    assert c.returncode == 2 and "409" in c.stderr and "batch_id" in c.stderr, c.stderr
    (tmp_path / "bad.jsonl").write_text(json.dumps({**lines[0], "body": {"prompt": "x", "max_tokens": "5"}}) + "\n")
    f = _cli("submit", str(tmp_path / "bad.jsonl"), "--endpoint", "/v1/completions", "--target", gw.url, "--wait")
    assert f.returncode == 1 and "failed" in f.stderr and "line 1:" in f.stderr and "max_tokens" in f.stderr, f.stderr


def test_the_command_through_the_python_api(deployment, tmp_path):
    """With a router target and no gateway on --jobs-dir, submit --wait runs the lines in the command's process;
    results on the store alone (no target) then writes them to stdout; without a target, a submit that no
    process would run is refused naming the directory."""
    jobs_dir = str(tmp_path / "jobs")
    _requests(tmp_path / "in.jsonl", n=3)
    p = _cli("submit", str(tmp_path / "in.jsonl"), "--endpoint", "/v1/completions", "--target", deployment.address,
             "--jobs-dir", jobs_dir, "--wait")
    assert p.returncode == 0 and "completed" in p.stderr, p.stderr
    r = _cli("results", p.stdout.strip(), "--jobs-dir", jobs_dir)
    got = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.returncode == 0 and sorted(x["custom_id"] for x in got) == ["r0", "r1", "r2"], r.stderr
    assert all(x["response"]["status_code"] == 200 for x in got)
    n = _cli("submit", str(tmp_path / "in.jsonl"), "--jobs-dir", jobs_dir)
    assert n.returncode == 2 and "no process runs the batches" in n.stderr and jobs_dir in n.stderr, n.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_progress_line(tty):
    """On a terminal the line is rewritten in place (\\r) and ends with one newline; elsewhere one line per
    change; the bar fills with the share of lines answered."""
    stream = _Terminal() if tty else io.StringIO()
    bar = ProgressLine(stream)
    for done in (0, 2, 4):
        bar.show({"id": "batch_x", "status": "in_progress" if done < 4 else "completed",
                  "request_counts": {"total": 4, "completed": done, "failed": 0}})
    bar.end()
    text = stream.getvalue()
    if tty:
        assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("\n")
        assert text.rstrip().endswith("completed")         # padded over the longer line before it
    else:
        assert "\r" not in text and len(text.splitlines()) == 3
    assert "[" + "#" * 15 + "." * 15 + "] 2/4" in text and "[" + "#" * 30 + "] 4/4" in text
