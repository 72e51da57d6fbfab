"""Background jobs: the OpenAI Files and Batches API's durable store, the runner of its lines, and the Python and
command-line ways in to it. docs/jobs.md describes the whole.

    store.py            JobStore: SQLite (WAL) and the files' bytes under jobs_dir; one transaction per change
    runner_lease.py     RunnerLease: the flock that makes one process the runner of a directory's lines
    batch_input.py      every line of a batch's input file checked up front
    batch_runner.py     BatchRunner: lines in flight, results as each finishes, resume after a restart
    limits.py           JobLimits and the checks that refuse past them, each naming its bound
    expiry.py           Expiry: files and batches deleted when their time is up, batches past their window
    stats.py            JobStats: the figures /metrics reads from the store
    upload.py           the multipart upload of POST /v1/files
    openai_objects.py   store rows → OpenAI's File and Batch objects
    job_client.py       JobClient: `client.jobs`, the store from Python without HTTP
    batch_http.py       HttpJobs: the same methods over a gateway's HTTP API
    batch_cli.py        `mii-async batch`: submit, status, results, cancel, list

The HTTP routes are gateway/batch_routes.py.
"""
from __future__ import annotations

from .batch_runner import BatchRunner
from .job_client import JobClient
from .limits import JobLimitError, JobLimits
from .store import JobStore

__all__ = ["BatchRunner", "JobClient", "JobLimitError", "JobLimits", "JobStore"]
