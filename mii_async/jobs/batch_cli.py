"""`mii-async batch`: submit a JSONL file of requests as a batch, follow it, fetch its results, cancel it.

    mii-async batch submit requests.jsonl --target http://127.0.0.1:8000 --wait
    mii-async batch status BATCH_ID --target http://127.0.0.1:8000
    mii-async batch results BATCH_ID -o results.jsonl
    mii-async batch cancel BATCH_ID
    mii-async batch list

Where a command goes (--target):
  http://HOST:PORT        the gateway's Files and Batches API (batch_http.py); the gateway runs the lines
  tcp://HOST:PORT or NAME the Python API (client.jobs) on --jobs-dir, over a client of that router: the process
                          holding the directory (a gateway that opened it) runs the lines, or when none does,
                          this command, for as long as it runs (`submit --wait`, `results`)
  none                    the store in --jobs-dir itself: status, results, cancel and list; `submit` only while
                          a process holds the directory to run the lines
Progress goes to stderr: one line rewritten in place on a terminal, a line per change otherwise. Results go to
stdout, or to -o FILE, one JSON line each (OpenAI's batch output line).

The job limits' flags (--jobs-max-file-bytes, --jobs-max-lines, --jobs-max-stored-bytes, --jobs-retention-s) are
defined here for this command (the Python API's targets: an http target's gateway has its own) and for `serve`
and `gateway` (cli.py), each an HttpConfig field.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Iterator, TextIO

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
BAR_WIDTH = 30
# HttpConfig field, flag, JobLimits field (its default is shown), what it bounds
LIMIT_FLAGS = (("jobs_max_file_bytes", "--jobs-max-file-bytes", "max_file_bytes", "bytes of one uploaded file"),
               ("jobs_max_lines", "--jobs-max-lines", "max_lines", "request lines in one batch"),
               ("jobs_max_stored_bytes", "--jobs-max-stored-bytes", "max_stored_bytes",
                "bytes of every stored file together (uploads past it are refused)"),
               ("jobs_retention_s", "--jobs-retention-s", "retention_s",
                "seconds a file without expires_after, or a batch that has ended, is kept"))


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """The job limits' flags (docs/jobs.md "Limits"); unset: JobLimits' defaults."""
    from .limits import JobLimits

    for field, flag, limit, text in LIMIT_FLAGS:
        p.add_argument(flag, type=int, default=None, dest=field, help=f"{text} (default: {getattr(JobLimits, limit)})")


def limit_fields(a: argparse.Namespace) -> dict[str, int]:
    """The HttpConfig fields of the job limits' flags that were given."""
    return {field: v for field, *_ in LIMIT_FLAGS if (v := getattr(a, field)) is not None}


def build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.description = "The Batch API from the command line: submit a JSONL file, follow it, fetch its results"
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default=None, help="http://HOST:PORT (a gateway's HTTP API), tcp://HOST:PORT or "
                        "a deployment's name (a router: the Python API on --jobs-dir; when no gateway holds the "
                        "directory, this command runs the lines); default: the store in --jobs-dir")
    common.add_argument("--jobs-dir", default=None, help="the store's directory, without an http target (default: "
                        "the gateway's, $MII_ASYNC_CACHE/jobs, else ~/.cache/mii_async/jobs)")
    common.add_argument("--api-key", default=None, help="for an http target (default: $MII_ASYNC_API_KEY)")
    common.add_argument("--curve-dir", default=None, help="the mesh's client keys, for a tcp target on another host")
    add_limit_args(common)
    sub = p.add_subparsers(dest="batch_command", required=True)
    s = sub.add_parser("submit", parents=[common], help="submit a JSONL file of requests; prints the batch's id")
    s.add_argument("file", help="one request a line: {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"}")
    s.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS, help="the route each line goes to")
    s.add_argument("--metadata", action="append", default=None, metavar="KEY=VALUE", help="repeatable")
    s.add_argument("--wait", action="store_true", help="follow the batch until it ends (exit 0 when completed)")
    s.set_defaults(func=_submit)
    st = sub.add_parser("status", parents=[common], help="print the batch (OpenAI's Batch object, JSON)")
    st.add_argument("batch_id")
    st.set_defaults(func=_status)
    r = sub.add_parser("results", parents=[common], help="write the batch's finished lines as they land (http: "
                       "once it ended), until it ends")
    r.add_argument("batch_id")
    r.add_argument("-o", "--output", default=None, help="the file to write (default: stdout)")
    r.set_defaults(func=_results)
    c = sub.add_parser("cancel", parents=[common], help="stop a batch; the lines that finished are kept")
    c.add_argument("batch_id")
    c.set_defaults(func=_cancel)
    ls = sub.add_parser("list", parents=[common], help="the batches, newest first")
    ls.add_argument("--limit", type=int, default=20, help="at most this many (1 to 100)")
    ls.set_defaults(func=_list)
    return p


@contextlib.contextmanager
def _jobs(a: argparse.Namespace) -> Iterator[Any]:
    """The target's job API: HttpJobs, or a JobClient (over a client of a router, or the store alone) with the
    limits the flags give."""
    from ..config import HttpConfig
    from .job_client import JobClient, default_jobs_dir

    if a.target is not None and a.target.startswith(("http://", "https://")):
        from .batch_http import HttpJobs

        yield HttpJobs(a.target, a.api_key or os.environ.get("MII_ASYNC_API_KEY"))
        return
    jobs_dir = os.path.abspath(a.jobs_dir) if a.jobs_dir else default_jobs_dir()
    http = HttpConfig(jobs_dir=jobs_dir, **limit_fields(a))     # a bad value: the error names its field
    if a.target is None:
        with JobClient(None, jobs_dir, http=http) as jobs:
            yield jobs
        return
    import mii_async

    client = mii_async.client(a.target, curve_dir=a.curve_dir)
    try:
        with JobClient(client, jobs_dir, http=http) as jobs:
            yield jobs
    finally:
        client.close()


def _runner_elsewhere(jobs_dir: str) -> bool:
    """Whether another process holds the directory's runner lease (and so runs the lines submitted to it)."""
    from .runner_lease import RunnerLease

    if not os.path.isdir(jobs_dir):
        return False
    lease = RunnerLease(jobs_dir)
    if lease.try_take():
        lease.release()
        return False
    return True


def _submit(a: argparse.Namespace) -> int:
    from ..errors import InvalidParameterError, UnavailableError

    metadata = None
    if a.metadata:
        pairs = [m.partition("=") for m in a.metadata]
        if any(not sep or not k for k, sep, _ in pairs):
            raise InvalidParameterError("metadata", f"give KEY=VALUE pairs, got {a.metadata}")
        metadata = {k: v for k, _, v in pairs}
    if not os.path.isfile(a.file):
        raise InvalidParameterError("file", f"no file {a.file!r}")
    with _jobs(a) as jobs:
        if a.target is None and not _runner_elsewhere(jobs.jobs_dir):
            raise UnavailableError(f"no process runs the batches of {jobs.jobs_dir}: start a gateway on it, give "
                                   "--target http://GATEWAY, or --target tcp://ROUTER with --wait (this command then "
                                   "runs the lines)")
        b = jobs.submit(a.file, endpoint=a.endpoint, metadata=metadata)
        print(b["id"], flush=True)
        if not a.wait:
            if getattr(jobs, "runs_lines", False):
                print(f"mii-async: no gateway holds {jobs.jobs_dir}: the lines run when a process opens it (a "
                      f"gateway, or `mii-async batch results {b['id']} --target {a.target}`)", file=sys.stderr)
            return 0
        b = _follow(jobs, b["id"])
    return 0 if b["status"] == "completed" else 1


def _follow(jobs: Any, batch_id: str) -> dict:
    """Shows the batch's progress until it ends, then a summary; the batch as it ended."""
    bar = ProgressLine(sys.stderr)
    b: dict = {}
    try:
        for b in jobs.progress(batch_id):
            bar.show(b)
    except KeyboardInterrupt:
        bar.end()
        print(f"mii-async: stopped following; the batch goes on where a gateway runs it (`mii-async batch status "
              f"{batch_id}`)", file=sys.stderr)
        raise SystemExit(130) from None
    bar.end()
    files = ", ".join(f"{k.split('_')[0]} file {b[k]}" for k in ("output_file_id", "error_file_id") if b.get(k))
    print(f"mii-async: batch {batch_id} {b['status']}" + (f" ({files})" if files else ""), file=sys.stderr)
    for e in (b.get("errors") or {}).get("data") or ():
        print(f"  line {e.get('line')}: {e.get('message')}", file=sys.stderr)
    return b


def _status(a: argparse.Namespace) -> int:
    with _jobs(a) as jobs:
        print(json.dumps(jobs.get(a.batch_id), indent=2))
    return 0


def _results(a: argparse.Namespace) -> int:
    from .batch_http import HttpJobs
    from .store import TERMINAL

    with _jobs(a) as jobs, (open(a.output, "w", encoding="utf-8") if a.output else
                            contextlib.nullcontext(sys.stdout)) as out:
        if isinstance(jobs, HttpJobs):
            if _follow(jobs, a.batch_id)["status"] == "failed":
                return 1
        elif a.target is None and not _runner_elsewhere(jobs.jobs_dir) and \
                jobs.get(a.batch_id)["status"] not in TERMINAL:
            print(f"mii-async: no process runs the batches of {jobs.jobs_dir} now: waiting for one (a gateway on it, "
                  "or this command with --target tcp://ROUTER)", file=sys.stderr)
        n = 0
        for line in jobs.results(a.batch_id):
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
            n += 1
    if a.output:
        print(f"mii-async: {n} lines written to {a.output}", file=sys.stderr)
    return 0


def _cancel(a: argparse.Namespace) -> int:
    with _jobs(a) as jobs:
        print(json.dumps(jobs.cancel(a.batch_id), indent=2))
    return 0


def _list(a: argparse.Namespace) -> int:
    with _jobs(a) as jobs:
        rows = jobs.list(limit=a.limit)
    print(f"{'ID':<40} {'STATUS':<12} {'DONE/TOTAL':>11} {'FAILED':>7}")
    for b in rows:
        c = b["request_counts"]
        print(f"{b['id']:<40} {b['status']:<12} {c['completed'] + c['failed']:>5}/{c['total']:<5} {c['failed']:>7}")
    return 0


def progress_text(b: dict) -> str:
    """One line for a batch: its id, a bar of the lines answered, the counts and the status."""
    c = b["request_counts"]
    done, total = c["completed"] + c["failed"], c["total"]
    filled = BAR_WIDTH * done // total if total else 0
    return f"{b['id']} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} ({c['failed']} failed) " \
           f"{b['status']}"


class ProgressLine:
    """A batch's progress on a stream: rewritten in place (\\r) on a terminal, one line per change otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.tty = stream, stream.isatty()
        self._width = 0

    def show(self, b: dict) -> None:
        text = progress_text(b)
        if self.tty:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
