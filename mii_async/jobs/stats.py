"""JobStats: the Files and Batches API's figures for /metrics, read from the store with aggregate queries on the
batches and files tables (a few rows each, never the lines) at each scrape.

Lines by state: `queued` and `running` are the unanswered lines of in-progress batches, `running` those in
flight in this process's runner (the one holding the directory's lease; 0 elsewhere); `completed` (a 2xx
answer) and `failed` (any other, batch_expired included) count the answered lines of every batch still stored.
The finished-lines counter grows by what those sums grew since the last scrape, plus the finished lines of the
batches this process's expiry deleted meanwhile, so a deletion never takes it down; it starts at 0 with the
process, as a Prometheus counter does. rate() of it is the batch line throughput.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .limits import JobLimits
from .store import JobStore

if TYPE_CHECKING:
    from .batch_runner import BatchRunner
    from .expiry import Expiry

BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")                       # OpenAI's, each reported (0 when none)
LINE_STATES = ("queued", "running", "completed", "failed")
OUTCOMES = ("completed", "failed")


class JobCounts(NamedTuple):
    batches: dict[str, int]         # status → batches stored in it
    lines: dict[str, int]           # state → lines (LINE_STATES)
    finished: dict[str, int]        # outcome → lines finished since this process started (a counter)
    stored_bytes: int               # the bytes of every stored file
    files: int                      # stored files
    max_stored_bytes: int           # JobLimits.max_stored_bytes

    @classmethod
    def empty(cls, limits: JobLimits) -> JobCounts:
        """A directory that holds no store yet: nothing stored, nothing finished."""
        return cls({s: 0 for s in BATCH_STATUSES}, {s: 0 for s in LINE_STATES}, {o: 0 for o in OUTCOMES}, 0, 0,
                   limits.max_stored_bytes)


class JobStats:
    def __init__(self, store: JobStore, runner: BatchRunner, expiry: Expiry | None, limits: JobLimits) -> None:
        self.store, self.runner, self.expiry, self.limits = store, runner, expiry, limits
        self._finished = {o: 0 for o in OUTCOMES}
        self._last = self._answered(store.batch_totals())

    def _answered(self, totals: list[dict]) -> dict[str, int]:
        """Answered lines of the stored batches (store.batch_totals) plus those of batches deleted here, by
        outcome: it only grows while this process alone deletes batches."""
        deleted = self.expiry.deleted_lines if self.expiry is not None else {}
        return {o: sum(r[o] for r in totals) + deleted.get(o, 0) for o in OUTCOMES}

    def read(self) -> JobCounts:
        batches = {s: 0 for s in BATCH_STATUSES}
        lines = {s: 0 for s in LINE_STATES}
        totals = self.store.batch_totals()
        for r in totals:
            batches[r["status"]] = r["n"]
            lines["completed"] += r["completed"]
            lines["failed"] += r["failed"]
            if r["status"] == "in_progress":
                lines["queued"] += r["unanswered"]
        lines["running"] = min(self.runner.in_flight(), lines["queued"])
        lines["queued"] -= lines["running"]
        now = self._answered(totals)
        for o in OUTCOMES:
            # Another process deleting batches takes a sum down: that scrape adds nothing, never subtracts.
            self._finished[o] += max(0, now[o] - self._last[o])
        self._last = now
        files, stored = self.store.file_totals()
        return JobCounts(batches, lines, dict(self._finished), stored, files, self.limits.max_stored_bytes)
