"""BatchRunner: runs the batches of one JobStore, line by line, on the gateway's event loop.

A batch goes validating → in_progress → finalizing → completed (or validating → failed; or → cancelling →
cancelled). Its lines run through `send` — the gateway's own route for the batch's endpoint — at most
`limits.max_in_flight` at once across every batch, oldest batch first (the slots are handed out in order). Each
line's result is committed the moment it finishes (store.finish_line); the output and error files are written
from those rows, in input order, when the last line is done.

Other processes: a runner runs lines only while its store holds the directory's lease (runner_lease.py); every
process's runner tries to take it at `start()` and at each poll. Every POLL_S the lease holder's runner reads
the store's unfinished batches: one another process submitted (validating) starts, and one another process
cancelled (cancelling) stops its lines, as a cancel here does. A runner without the lease runs nothing; its
process's submits and cancels reach the holder through the store.

Restart: taking the lease (at `start()`, or later when its holder exited) takes up every batch the store holds
in an unfinished state. A line whose result was committed is never sent again; a line that was running when the
process died has no result and runs again (its earlier run left nothing behind). A 503 (the router overloaded,
or not up yet after a restart) is not an answer for the line: it is sent again after a pause, up to RETRY_MAX_S
apart, until the batch is cancelled.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from .batch_input import BodyCheck, parse_batch_input
from .limits import JobLimits
from .store import ACTIVE, JobStore, Line, new_id

log = logging.getLogger("mii_async.jobs")
# send(url, body) → (HTTP status, JSON body): the route's answer to one line
Send = Callable[[str, dict], Awaitable[tuple[int, Any]]]
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
POLL_S = 0.5                 # how often a runner reads the store for batches and cancels of other processes


class BatchRunner:
    def __init__(self, store: JobStore, send: Send, check_body: BodyCheck, limits: JobLimits) -> None:
        self.store, self._send, self._check_body, self.limits = store, send, check_body, limits
        self._slots = asyncio.Semaphore(limits.max_in_flight)
        self._tasks: dict[str, asyncio.Task] = {}            # batch id → the task that runs it
        self._running: dict[str, set[asyncio.Task]] = {}     # batch id → its lines in flight
        self._cancelled: set[str] = set()
        self._broken: set[str] = set()                       # batches stopped by an error: left for a restart
        # Batches whose task stop() cancelled (the expiry sweep, before it moves the batch on itself): not taken
        # up again while they are still validating or in progress.
        self._held: set[str] = set()
        self._closing = False
        self._poll_task: asyncio.Task | None = None
        self._poked = asyncio.Event()

    def start(self) -> None:
        """Takes the lease if it is free, then the batches left unfinished (by a stop, or a crash), and polls the
        store from now on. Call on the loop that is to run the lines."""
        self.poll_once()
        self._poll_task = asyncio.ensure_future(self._poll())

    def poke(self) -> None:
        """Polls now rather than at the next POLL_S (a batch was just submitted). On the runner's loop."""
        self._poked.set()

    async def _poll(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._poked.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass
            self._poked.clear()
            try:
                self.poll_once()
            except Exception as exc:  # noqa: BLE001 - a busy or failing database: try again at the next poll
                log.error("reading the job store failed", exc_info=exc)

    def poll_once(self) -> None:
        """Starts the unfinished batches nobody runs here, and stops the lines of those cancelled elsewhere."""
        if not self.store.owns:
            if not self.store.try_own():
                return
            log.info("this process runs the batches of %s now", self.store.dir)
        active = self.store.active_batches()
        self._held &= {b["id"] for b in active}
        for b in active:
            batch_id = b["id"]
            if batch_id in self._tasks:
                if b["status"] == "cancelling" and batch_id not in self._cancelled:
                    self._stop_lines(batch_id)
            elif batch_id in self._broken:
                continue
            elif batch_id in self._held and b["status"] in ("validating", "in_progress"):
                continue
            else:
                self._held.discard(batch_id)
                if b["status"] != "validating":
                    log.info("resuming batch %s (%s)", batch_id, b["status"])
                self.submit(batch_id)

    def submit(self, batch_id: str) -> None:
        """Runs a batch the store holds as validating (or one left unfinished), in a task of its own; nothing
        without the lease (the holder's runner finds the batch when it polls)."""
        if not self.store.owns or batch_id in self._tasks:
            return
        task = asyncio.ensure_future(self._run(batch_id))
        self._tasks[batch_id] = task
        task.add_done_callback(lambda t: self._done(batch_id, t))

    def _done(self, batch_id: str, task: asyncio.Task) -> None:
        self._tasks.pop(batch_id, None)
        self._cancelled.discard(batch_id)
        if task.cancelled():
            if not self._closing:
                self._held.add(batch_id)
        elif task.exception() is not None:
            self._broken.add(batch_id)
            log.error("batch %s stopped on an error; it resumes at the next start", batch_id,
                      exc_info=task.exception())

    def cancel(self, batch_id: str) -> dict | None:
        """Moves a batch that has not ended to cancelling: no further line starts, those in flight are aborted
        (they stay unanswered), and the batch ends as cancelled with the lines that had finished. None when
        there is no such batch; the batch unchanged when it had ended already."""
        b = self.store.get_batch(batch_id)
        if b is None:
            return None
        if self.store.set_status(batch_id, "cancelling", "cancelling_at", ("validating", "in_progress")):
            self._stop_lines(batch_id)
            self.submit(batch_id)
        return self.store.get_batch(batch_id)

    async def stop(self, batch_id: str) -> None:
        """Cancels the task that runs the batch here, if any, and waits for it to end: its lines in flight are
        aborted and stay unanswered. The runner then leaves the batch alone while it is still validating or in
        progress (the caller moves it on: the expiry sweep, to expired). On the runner's loop; cancelling the
        wait leaves the task cancelled all the same."""
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def in_flight(self) -> int:
        """The lines running here now, all batches together."""
        return sum(len(lines) for lines in self._running.values())

    def _stop_lines(self, batch_id: str) -> None:
        self._cancelled.add(batch_id)
        for t in list(self._running.get(batch_id, ())):
            t.cancel()

    async def close(self) -> None:
        """Stops polling, and every batch where it is: its lines in flight are aborted and stay pending for the
        next start."""
        self._closing = True
        tasks = list(self._tasks.values()) + ([self._poll_task] if self._poll_task is not None else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, batch_id: str) -> None:
        b = self.store.get_batch(batch_id)
        if b is None or b["status"] not in ACTIVE:
            return
        if b["status"] == "validating" and not await self._validate(b):
            return
        if self.store.get_batch(batch_id)["status"] == "in_progress":
            await self._run_lines(batch_id)
        self.store.choose_output_ids(batch_id)
        # After this move a cancel (only from validating or in_progress) can no longer land, in any process.
        self.store.set_status(batch_id, "finalizing", "finalizing_at", ("in_progress",))
        status = self.store.get_batch(batch_id)["status"]
        if status == "cancelling":
            self.store.finish_batch(batch_id, "cancelled", "cancelled_at")
        elif status == "finalizing":
            self.store.finish_batch(batch_id, "completed", "completed_at")
        # else another actor (the expiry sweep) moved the batch on, and writes its files itself

    async def _validate(self, b: dict) -> bool:
        """Checks the input file whole (batch_input.py); False when the batch failed validation."""
        if self.store.get_file(b["input_file_id"]) is None:
            self.store.fail_validation(b["id"], [{"code": "invalid_file", "line": None, "param": "input_file_id",
                                                  "message": f"the input file {b['input_file_id']} was deleted"}])
            return False
        data = self.store.read_file(b["input_file_id"])
        lines, errors = await asyncio.get_running_loop().run_in_executor(
            None, parse_batch_input, data, b["endpoint"], self._check_body, self.limits.max_lines)
        if errors:
            self.store.fail_validation(b["id"], errors)
            return False
        self.store.start_batch(b["id"], lines)
        return True

    async def _run_lines(self, batch_id: str) -> None:
        running = self._running.setdefault(batch_id, set())
        try:
            for line in self.store.pending_lines(batch_id):
                await self._slots.acquire()
                if batch_id in self._cancelled:
                    self._slots.release()
                    break
                t = asyncio.ensure_future(self._run_line(batch_id, line))
                running.add(t)
                t.add_done_callback(lambda t: (running.discard(t), self._slots.release()))
            await asyncio.gather(*running, return_exceptions=True)
        finally:
            for t in list(running):
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            self._running.pop(batch_id, None)

    async def _run_line(self, batch_id: str, line: Line) -> None:
        delay = RETRY_FIRST_S
        try:
            while True:
                status, body = await self._send(line.url, line.body)
                if status != 503:
                    break
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
            request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
            result = {"id": new_id("batch_req_"), "custom_id": line.custom_id,
                      "response": {"status_code": status, "request_id": request_id or new_id("req_"),
                                   "body": body}, "error": None}
            ok = 200 <= status < 300
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a fault of ours on one line fails that line, not the batch
            log.error("batch %s line %d failed", batch_id, line.idx, exc_info=exc)
            result = {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
                      "error": {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}}
            ok = False
        self.store.finish_line(batch_id, line.idx, result, ok)
