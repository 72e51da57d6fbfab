"""A small background job service: a bounded queue of jobs, N worker tasks, a timeout per job.

Start a deployment in another terminal (the router listens on tcp://127.0.0.1:5555 by default):

    .venv/bin/mii-async serve

then run:

    .venv/bin/python examples/background_jobs.py --router tcp://127.0.0.1:5555 --jobs 6 --workers 3

The producer puts jobs on an `asyncio.Queue(maxsize=…)`: when the workers fall behind, `put` waits, so memory
stays bounded however many jobs come (backpressure). Each worker takes a job and awaits `client.generate`
under the job's timeout. A job that runs past its timeout is cancelled, and cancelling the awaiting task
aborts the request on the server, which frees its KV blocks within a step: no work goes on for an answer
nobody will read. To show that, one deliberately long job (`--slow-job-timeout`, 0 to leave it out) runs with
a tiny timeout, and at the end the server's counters are printed: nothing is left running.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from typing import NamedTuple

import mii_async

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 2 + 2?",
             "Who wrote Romeo and Juliet?", "What is the boiling point of water?", "Say hello in Spanish."]


class Job(NamedTuple):
    id: int
    question: str
    max_new_tokens: int
    timeout_s: float           # from when a worker starts the job, not from when it was queued
    ignore_eos: bool = False   # True: always generate max_new_tokens (the deliberately slow job)


class Result(NamedTuple):
    job: Job
    status: str                # "done" | "cancelled" (ran past its timeout) | "failed"
    seconds: float
    text: str = ""
    tokens: int = 0
    finish_reason: str = ""
    error: str = ""


async def run_job(client: mii_async.AsyncClient, job: Job) -> Result:
    start = time.perf_counter()
    messages = [{"role": "user", "content": job.question}]
    try:
        # wait_for cancels generate() at the deadline and waits for it to unwind; generate's cancellation
        # sends an Abort to the router, which stops the request on its replica.
        [r] = await asyncio.wait_for(
            client.generate(messages, max_new_tokens=job.max_new_tokens, temperature=0, ignore_eos=job.ignore_eos),
            job.timeout_s)
    except asyncio.TimeoutError:
        return Result(job, "cancelled", time.perf_counter() - start,
                      error=f"ran past its {job.timeout_s:g} s timeout; aborted on the server")
    except mii_async.MIIAsyncError as exc:    # refused (bad parameter, overloaded) or the deployment is gone
        return Result(job, "failed", time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
    if r.finish_reason == "error":            # the replica failed mid-request
        return Result(job, "failed", time.perf_counter() - start, error=r.error or "generation failed")
    return Result(job, "done", time.perf_counter() - start, r.generated_text, r.generated_length, r.finish_reason)


async def worker(client: mii_async.AsyncClient, queue: asyncio.Queue[Job], results: list[Result]) -> None:
    """Takes jobs until cancelled. A job's failure is its result: it never stops the worker."""
    while True:
        job = await queue.get()
        try:
            results.append(await run_job(client, job))
        except Exception as exc:  # noqa: BLE001 - a bug in one job must not stall queue.join() forever
            results.append(Result(job, "failed", 0.0, error=f"{type(exc).__name__}: {exc}"))
        finally:
            queue.task_done()


async def server_idle(client: mii_async.AsyncClient, timeout_s: float = 5.0) -> dict:
    """The engines' counters once every replica answered with no request running or waiting (or after
    `timeout_s`). On a shared deployment other clients' requests count here too."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await client.stats()
        idle = not stats["unanswered"] and stats["running"] == 0 and stats["waiting"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def run(router: str, jobs: list[Job], n_workers: int, queue_size: int) -> int:
    client = mii_async.client(router, timeout_s=30.0)
    queue: asyncio.Queue[Job] = asyncio.Queue(maxsize=queue_size)
    results: list[Result] = []
    steps_before = (await client.stats())["steps"]     # engine steps so far, summed over replicas
    start = time.perf_counter()
    workers = [asyncio.create_task(worker(client, queue, results), name=f"worker-{i}") for i in range(n_workers)]
    try:
        for job in jobs:
            await queue.put(job)              # waits while the queue is full: backpressure on the producer
        await queue.join()                    # every job has a result
        elapsed = time.perf_counter() - start
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    try:
        for r in sorted(results, key=lambda r: r.job.id):
            detail = (f"{r.tokens} tokens, {r.finish_reason} | {r.job.question} → {r.text.strip()!r}"
                      if r.status == "done" else r.error)
            print(f"job {r.job.id:2d} {r.status:9s} {r.seconds:6.2f}s  {detail}")
        count = {s: sum(r.status == s for r in results) for s in ("done", "cancelled", "failed")}
        print(f"summary: {count['done']} done, {count['cancelled']} cancelled, {count['failed']} failed; "
              f"{len(results)} jobs in {elapsed:.2f}s with {n_workers} workers")
        stats = await server_idle(client)
        # Had the cancelled job gone on generating on the server, the engine would have needed at least its
        # max_new_tokens steps; with the abort it stops within a step of the timeout.
        longest = max(j.max_new_tokens for j in jobs) if jobs else 0
        print(f"server after the run: running={stats['running']} waiting={stats['waiting']} "
              f"used_blocks={stats['used_blocks']}; {stats['steps'] - steps_before} engine steps "
              f"(the longest job asked for {longest} tokens, one step each)")
        return 1 if count["failed"] else 0
    finally:
        client.close()


def make_jobs(n: int, max_new_tokens: int, timeout_s: float, slow_job_timeout_s: float) -> list[Job]:
    ids = itertools.count()
    jobs = []
    if slow_job_timeout_s > 0:
        # First, so that it runs beside the others: its abort must not disturb them.
        jobs.append(Job(next(ids), "Write a very long story about a dragon.", 512, slow_job_timeout_s,
                        ignore_eos=True))
    jobs += [Job(next(ids), q, max_new_tokens, timeout_s) for q in itertools.islice(itertools.cycle(QUESTIONS), n)]
    return jobs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="tcp://127.0.0.1:5555", help="the router's client address")
    p.add_argument("--jobs", type=int, default=6, help="ordinary jobs to run")
    p.add_argument("--workers", type=int, default=3, help="jobs in flight at once")
    p.add_argument("--queue-size", type=int, default=4, help="jobs waiting at most, before the producer waits")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds each ordinary job may take")
    p.add_argument("--slow-job-timeout", type=float, default=0.5,
                   help="the timeout of one extra, deliberately long job, to show cancellation (0: no such job)")
    a = p.parse_args(argv)
    if a.jobs < 0 or a.workers < 1 or a.queue_size < 1:
        p.error("--jobs must be ≥ 0, --workers and --queue-size ≥ 1")
    jobs = make_jobs(a.jobs, a.max_new_tokens, a.timeout, a.slow_job_timeout)
    try:
        return asyncio.run(run(a.router, jobs, a.workers, a.queue_size))
    except mii_async.MIIAsyncError as exc:    # e.g. the router is unreachable
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
