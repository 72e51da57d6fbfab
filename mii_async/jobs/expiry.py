"""Expiry: how long the Files and Batches API keeps what it stores, and the sweep that deletes what has expired.

- A file expires at created_at + its upload's `expires_after.seconds` (OpenAI's `{"anchor": "created_at",
  "seconds": N}`, 3600 ≤ N ≤ 30 days), else at created_at + JobLimits.retention_s (a batch's output and error
  files included). The sweep deletes its row, then its bytes. The input file of a batch still validating is
  kept until the batch has read it.
- A batch that has ended is deleted with its lines at created_at + retention_s; its output and error files go
  at their own time.
- A batch still validating or in progress at its expires_at (created_at + its completion_window) ends as
  `expired`, as OpenAI defines it: its lines in flight are aborted, every line not answered yet goes to the
  error file as `batch_expired` (counted failed), and the answered ones stay in the output and error files.

The sweep runs where the lines run: in the process holding the directory's runner lease, once when the store
opens (before the runner takes up any batch), then every JobLimits.sweep_interval_s; `sweep(now)` runs one
at once (tests pass a later `now`). Its state is in the store's database (store.py): the table `file_expiry` (a
file's own expiry time) and the batches' column `expired_at`, set when an expired batch's files are written — a
batch `expired` without it was stopped part way and the next sweep finishes it.
"""
from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import logging
import time
from typing import TYPE_CHECKING, NamedTuple

from ..errors import InvalidParameterError
from .limits import JobLimits
from .store import JobStore, new_id

if TYPE_CHECKING:
    from .batch_runner import BatchRunner

log = logging.getLogger("mii_async.jobs")
FILE_EXPIRY_MIN_S = 3600                   # OpenAI's bounds on a file's expires_after.seconds
FILE_EXPIRY_MAX_S = 30 * 24 * 3600
EXPIRED_LINE_ERROR = {"code": "batch_expired",
                      "message": "This request could not be executed before the completion window expired."}
_EXPIRING = ("validating", "in_progress")  # a batch still here at its expires_at expires


class Swept(NamedTuple):
    expired_batches: list[str]         # moved to expired by this sweep
    deleted_batches: list[str]
    deleted_files: list[str]


class Expiry:
    """The expiry sweep of one store and its runner. `start()` runs it every sweep_interval_s on the calling
    loop; `close()` stops that."""

    def __init__(self, store: JobStore, runner: BatchRunner, limits: JobLimits) -> None:
        self.store, self.runner, self.limits = store, runner, limits
        # Finished lines of the batches this process deleted, by outcome: /metrics' finished-line counter adds
        # them back, so that it never goes down when a batch is deleted.
        self.deleted_lines = {"completed": 0, "failed": 0}
        self._task: asyncio.Task | None = None

    def file_expires_at(self, row: dict) -> int:
        """When the file of this row (store.get_file's) expires, in Unix seconds."""
        own = row["expires_at"]
        return own if own is not None else row["created_at"] + self.limits.retention_s

    # --- the sweep

    def start(self) -> None:
        """Sweeps every sweep_interval_s from now on, on the running loop."""
        self._task = asyncio.ensure_future(self._every())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _every(self) -> None:
        while True:
            await asyncio.sleep(self.limits.sweep_interval_s)
            try:
                await self.sweep()
            except Exception as exc:  # noqa: BLE001 - a busy or failing database: the next sweep tries again
                log.error("the expiry sweep failed; it runs again in %.0f s", self.limits.sweep_interval_s,
                          exc_info=exc)

    def sweep_before_start(self, now: int | None = None) -> Swept:
        """One sweep while the runner runs no batch (before its `start()`): blocks until done."""
        now = int(time.time()) if now is None else now
        if not self.store.owns:
            return Swept([], [], [])
        expired = [b for b in self.store.overdue_batches(now, _EXPIRING) if self._begin_expiry(b)]
        for b in self.store.unwritten_expiries():
            self._finish_expiry(b)
        return Swept(expired, *self._delete_old(now))

    async def sweep(self, now: int | None = None) -> Swept:
        """One sweep now (`now`: Unix seconds, default the clock), on the runner's loop. An overdue batch's task
        is stopped (its lines in flight aborted) before the batch is moved to expired; its result files are then
        written on a thread. Cancelled part way, it leaves the rest to the next sweep."""
        now = int(time.time()) if now is None else now
        if not self.store.owns:
            return Swept([], [], [])
        expired = []
        for batch_id in self.store.overdue_batches(now, _EXPIRING):
            await self.runner.stop(batch_id)
            # No await from here to the move: the runner cannot take the batch up again in between.
            if self._begin_expiry(batch_id):
                expired.append(batch_id)
        loop = asyncio.get_running_loop()
        for batch_id in self.store.unwritten_expiries():
            await loop.run_in_executor(None, self._finish_expiry, batch_id)
        return Swept(expired, *self._delete_old(now))

    def _begin_expiry(self, batch_id: str) -> bool:
        """Moves the batch to expired unless it moved on meanwhile (cancelled, say); expired_at stays unset
        until its files are written."""
        return self.store.set_status(batch_id, "expired", None, _EXPIRING)

    def _finish_expiry(self, batch_id: str) -> None:
        """Its unanswered lines into the error file as batch_expired, then its files and expired_at. Each step
        may run again after a crash: an answered line is never overwritten and the file ids are chosen once."""
        for line in self.store.pending_lines(batch_id):
            result = {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
                      "error": dict(EXPIRED_LINE_ERROR)}
            self.store.finish_line(batch_id, line.idx, result, ok=False)
        self.store.choose_output_ids(batch_id)
        self.store.finish_batch(batch_id, "expired", "expired_at")
        log.info("batch %s expired: its completion window ended before its lines did", batch_id)

    def _delete_old(self, now: int) -> tuple[list[str], list[str]]:
        ended = self.store.ended_batches(created_by=now - self.limits.retention_s)
        for b in ended:
            self.store.delete_batch(b["id"])
            self.deleted_lines["completed"] += b["completed"]
            self.deleted_lines["failed"] += b["failed"]
        files = self.store.expired_files(now, self.limits.retention_s)
        for file_id in files:
            self.store.delete_file(file_id)
        return [b["id"] for b in ended], files


def start_jobs(runner: BatchRunner, expiry: Expiry) -> None:
    """Starts a process's runner and sweep, on the loop that is to run the lines — a gateway's and client.jobs'
    alike. When the directory's lease is free this process takes it and sweeps once before the runner takes up
    any batch, so a batch that passed its window while no process ran it expires rather than resumes; then the
    runner starts (it takes the lease later if another process holds it now) and the sweep repeats."""
    if expiry.store.try_own():
        try:
            expiry.sweep_before_start()
        except Exception as exc:  # noqa: BLE001 - the API still serves; the next sweep tries again
            log.error("the expiry sweep at the store's opening failed", exc_info=exc)
    runner.start()
    expiry.start()


def upload_expires_after(content_type: str, body: bytes) -> int | None:
    """The seconds of an upload's `expires_after` — multipart fields `expires_after[anchor]` and
    `expires_after[seconds]` as the openai package sends them, or one field `expires_after` holding that JSON
    object; None when the upload gives none. InvalidParameterError naming the field at fault."""
    if b"expires_after" not in body:         # most uploads: no second parse of the body
        return None
    fields = _form_fields(content_type, body)
    if "expires_after" in fields:
        try:
            given = json.loads(fields.pop("expires_after"))
        except ValueError:
            given = None
        if not isinstance(given, dict):
            raise InvalidParameterError("expires_after", 'must be {"anchor": "created_at", "seconds": N}')
        fields.update({f"expires_after[{k}]": str(v) for k, v in given.items()})
    if not fields:
        return None
    unknown = sorted(set(fields) - {"expires_after[anchor]", "expires_after[seconds]"})
    if unknown:
        raise InvalidParameterError(_param(unknown[0]), "expires_after takes 'anchor' and 'seconds' only")
    if fields.get("expires_after[anchor]") != "created_at":
        raise InvalidParameterError("expires_after.anchor", "must be 'created_at', got "
                                    f"{fields.get('expires_after[anchor]')!r}")
    raw = fields.get("expires_after[seconds]", "").strip()
    if not raw.isascii() or not raw.isdigit() or not FILE_EXPIRY_MIN_S <= int(raw) <= FILE_EXPIRY_MAX_S:
        raise InvalidParameterError("expires_after.seconds", f"must be a whole number of seconds from "
                                    f"{FILE_EXPIRY_MIN_S} to {FILE_EXPIRY_MAX_S} (30 days), got {raw!r}")
    return int(raw)


def _param(field: str) -> str:
    return field.replace("[", ".").replace("]", "")


def _form_fields(content_type: str, body: bytes) -> dict[str, str]:
    """The text fields of a multipart/form-data body whose names start with expires_after."""
    head = b"Content-Type: " + content_type.encode("latin-1") + b"\r\nMIME-Version: 1.0\r\n\r\n"
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    fields: dict[str, str] = {}
    if not msg.is_multipart():
        return fields
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str) and name.startswith("expires_after") and part.get_filename() is None:
            fields[name] = (part.get_payload(decode=True) or b"").decode("utf-8", "replace").strip()
    return fields
