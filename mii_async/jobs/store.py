"""JobStore: the durable state of the Files and Batches API — one SQLite database (WAL) and the files' bytes.

Layout of `jobs_dir`:
    jobs.sqlite3        files' metadata, batches, and one row per input line of a batch (its body, then its
                        result once it finished)
    files/<file_id>     each file's bytes, written to a temporary name, fsynced, then renamed into place
    lock                held (flock, runner_lease.py) by the one process whose runner runs the lines

Many processes may open one directory: a gateway, a client's `jobs` API, the `mii-async batch` command. Each
uploads, submits, reads and cancels through its own connection (WAL lets readers and the one writer of the
moment go on together; a writer waits up to BUSY_TIMEOUT_S for another's transaction). Only the process holding
the lease runs lines, so every line runs in one place; the others' submits and cancels are row changes that
the runner finds when it polls the store (batch_runner.py). Within a process, a store's one connection is
guarded by a lock, so threads (validation, an async caller's executor) may share it.

Each state change is one transaction, so a process killed at any instant (kill -9) leaves either the line's
result committed or the line still pending: on the next start, pending lines run again and finished ones are
never rerun. WAL with synchronous=NORMAL is durable against a process's death (not a power cut, which may lose
the last transactions but never corrupts).
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from typing import Any, Iterator, NamedTuple

from ..errors import InvalidParameterError, UnavailableError
from .runner_lease import RunnerLease

DB_NAME = "jobs.sqlite3"
BUSY_TIMEOUT_S = 30.0        # how long a write waits for another process's transaction before it fails
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,            -- batch (uploaded), batch_output (a batch's output or error file)
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL       -- Unix seconds
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- creation order: lists and resumption follow it
    id TEXT UNIQUE NOT NULL,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,                    -- JSON object or NULL
    status TEXT NOT NULL,             -- validating, failed, in_progress, finalizing, completed, expired,
                                      -- cancelling, cancelled
    errors TEXT,                      -- JSON list of {code, message, param, line} when validation failed
    created_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER, expires_at INTEGER NOT NULL,
    expired_at INTEGER,               -- set once an expired batch's output and error files are written
    output_file_id TEXT, error_file_id TEXT,   -- chosen on entering finalizing; shown once the files exist
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,             -- 0-based line of the input file: the output file's order
    custom_id TEXT NOT NULL,
    url TEXT NOT NULL,
    body TEXT NOT NULL,               -- the request body, JSON (ASCII: a lone surrogate is kept escaped)
    result TEXT,                      -- the output line (JSON) once finished; NULL while pending
    ok INTEGER,                       -- 1: a 2xx answer (output file), 0: an error (error file)
    done_seq INTEGER,                 -- 1, 2, … in the order the batch's lines finished (results() follows it)
    PRIMARY KEY (batch_id, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS file_expiry (
    file_id TEXT PRIMARY KEY,
    expires_at INTEGER NOT NULL       -- Unix seconds: created_at + the upload's expires_after.seconds
) WITHOUT ROWID;
"""
# Columns that a store made by an earlier version lacks: _migrate adds them when it is opened
_ADDED_COLUMNS = (("lines", "done_seq", "INTEGER"), ("batches", "expired_at", "INTEGER"))
_DONE_INDEX = "CREATE INDEX IF NOT EXISTS lines_done ON lines (batch_id, done_seq)"
_FILES = "SELECT f.*, e.expires_at FROM files f LEFT JOIN file_expiry e ON e.file_id = f.id"
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")   # a runner has work left on these
TERMINAL = ("failed", "completed", "cancelled", "expired")


class Line(NamedTuple):
    idx: int
    custom_id: str
    url: str
    body: dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _marks(values: tuple[str, ...]) -> str:
    return ",".join("?" * len(values))


class JobStore:
    """The database and the files' directory of one `jobs_dir`. `exclusive`: take the runner's lease now, or
    raise UnavailableError naming jobs_dir when another process holds it; otherwise the lease is taken later, if
    ever, with `try_own()`. `close()` releases the lease."""

    def __init__(self, jobs_dir: str, *, exclusive: bool = True) -> None:
        self.dir = jobs_dir
        self.files_dir = os.path.join(jobs_dir, "files")
        os.makedirs(self.files_dir, exist_ok=True)
        self._lease = RunnerLease(jobs_dir)
        if exclusive and not self._lease.try_take():
            raise UnavailableError(f"jobs_dir {jobs_dir!r} is in use: another process runs its batches")
        self._db = sqlite3.connect(os.path.join(jobs_dir, DB_NAME), timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
        self._mutex = threading.Lock()
        with self._mutex:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._migrate()

    def _migrate(self) -> None:
        """Adds the columns the store lacks. Lines that finished in a store without done_seq have none, and
        results() gives them first, in input order."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for table, column, kind in _ADDED_COLUMNS:
                if column not in [r[1] for r in self._db.execute(f"PRAGMA table_info({table})")]:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            self._db.execute(_DONE_INDEX)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    @property
    def owns(self) -> bool:
        """Whether this store holds the directory's runner lease: its process is the one that runs lines."""
        return self._lease.held

    def try_own(self) -> bool:
        """Takes the runner lease if no process holds it (its holder may have exited); True if held now."""
        return self._lease.try_take()

    @staticmethod
    def exists(jobs_dir: str) -> bool:
        return os.path.exists(os.path.join(jobs_dir, DB_NAME))

    def close(self) -> None:
        with self._mutex:
            self._db.close()
        self._lease.release()

    def _tx(self, statements: list[tuple[str, tuple]]) -> None:
        with self._mutex:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self._db.execute(sql, args)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _rows(self, sql: str, args: tuple = ()) -> list[dict]:
        with self._mutex:
            cur = self._db.execute(sql, args)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]

    # --- files

    def file_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, file_id)

    def _write_bytes(self, file_id: str, chunks: Iterator[bytes]) -> int:
        tmp = self.file_path(file_id) + ".tmp"
        size = 0
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
                size += len(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.file_path(file_id))
        return size

    def add_file(self, filename: str, purpose: str, data: bytes, expires_after_s: int | None = None) -> dict:
        """Stores an uploaded file: its bytes first, then its row (a file without a row is never shown), with
        its own expiry time when the upload gave one (expiry.py)."""
        file_id = new_id("file-")
        size = self._write_bytes(file_id, iter((data,)))
        now = int(time.time())
        stmts = [("INSERT INTO files VALUES (?, ?, ?, ?, ?)", (file_id, filename, purpose, size, now))]
        if expires_after_s is not None:
            stmts.append(("INSERT INTO file_expiry VALUES (?, ?)", (file_id, now + expires_after_s)))
        self._tx(stmts)
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> dict | None:
        """The file's row, with `expires_at`: its own expiry time, or None when it has none."""
        rows = self._rows(f"{_FILES} WHERE f.id = ?", (file_id,))
        return rows[0] if rows else None

    def list_files(self, purpose: str | None = None) -> list[dict]:
        """Newest first, as get_file gives each."""
        if purpose is None:
            return self._rows(f"{_FILES} ORDER BY f.created_at DESC, f.rowid DESC")
        return self._rows(f"{_FILES} WHERE f.purpose = ? ORDER BY f.created_at DESC, f.rowid DESC", (purpose,))

    def file_totals(self) -> tuple[int, int]:
        """The number of stored files and their bytes together."""
        row = self._rows("SELECT COUNT(*) AS n, COALESCE(SUM(bytes), 0) AS bytes FROM files")[0]
        return row["n"], row["bytes"]

    def stored_bytes(self) -> int:
        """The bytes of every stored file (JobLimits.max_stored_bytes bounds them)."""
        return self.file_totals()[1]

    def expired_files(self, now: int, retention_s: int) -> list[str]:
        """The files whose time is up at `now`: their own expiry, else created_at + retention_s; the input file
        of a batch still validating is kept until the batch has read it. Oldest first."""
        rows = self._rows("SELECT f.id FROM files f LEFT JOIN file_expiry e ON e.file_id = f.id "
                          "WHERE COALESCE(e.expires_at, f.created_at + ?) <= ? AND f.id NOT IN "
                          "(SELECT input_file_id FROM batches WHERE status = 'validating') ORDER BY f.created_at",
                          (retention_s, now))
        return [r["id"] for r in rows]

    def read_file(self, file_id: str) -> bytes:
        with open(self.file_path(file_id), "rb") as f:
            return f.read()

    def delete_file(self, file_id: str) -> bool:
        """Deletes the row, then the bytes; False when there was no such file."""
        if self.get_file(file_id) is None:
            return False
        self._tx([("DELETE FROM files WHERE id = ?", (file_id,)), ("DELETE FROM file_expiry WHERE file_id = ?",
                                                                   (file_id,))])
        try:
            os.remove(self.file_path(file_id))
        except FileNotFoundError:
            pass
        return True

    # --- batches

    def add_batch(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None,
                  window_s: int) -> dict:
        batch_id, now = new_id("batch_"), int(time.time())
        self._tx([("INSERT INTO batches (id, input_file_id, endpoint, completion_window, metadata, status, "
                   "created_at, expires_at) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?)",
                   (batch_id, input_file_id, endpoint, completion_window,
                    None if metadata is None else json.dumps(metadata), now, now + window_s))])
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> dict | None:
        rows = self._rows("SELECT * FROM batches WHERE id = ?", (batch_id,))
        return rows[0] if rows else None

    def list_batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Newest first, those after the batch `after` in that order; and whether more follow."""
        if after is None:
            rows = self._rows("SELECT * FROM batches ORDER BY seq DESC LIMIT ?", (limit + 1,))
        else:
            anchor = self.get_batch(after)
            if anchor is None:
                raise InvalidParameterError("after", f"no batch {after!r}")
            rows = self._rows("SELECT * FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                              (anchor["seq"], limit + 1))
        return rows[:limit], len(rows) > limit

    def active_batches(self) -> list[dict]:
        """The batches a runner has work left on, oldest first."""
        return self._rows(f"SELECT * FROM batches WHERE status IN ({_marks(ACTIVE)}) ORDER BY seq", ACTIVE)

    def overdue_batches(self, now: int, statuses: tuple[str, ...]) -> list[str]:
        """The batches in one of `statuses` whose expires_at has come at `now`, oldest first."""
        rows = self._rows(f"SELECT id FROM batches WHERE status IN ({_marks(statuses)}) AND expires_at <= ? "
                          "ORDER BY seq", (*statuses, now))
        return [r["id"] for r in rows]

    def unwritten_expiries(self) -> list[str]:
        """The batches moved to expired whose files are not written yet (expired_at unset), oldest first."""
        return [r["id"] for r in self._rows("SELECT id FROM batches WHERE status = 'expired' AND expired_at IS NULL "
                                            "ORDER BY seq")]

    def ended_batches(self, created_by: int) -> list[dict]:
        """The batches that have ended (their files written) and were created at `created_by` or before, oldest
        first: each its id and its completed and failed counts."""
        return self._rows(f"SELECT id, completed, failed FROM batches WHERE status IN ({_marks(TERMINAL)}) AND "
                          "created_at <= ? AND NOT (status = 'expired' AND expired_at IS NULL) ORDER BY seq",
                          (*TERMINAL, created_by))

    def delete_batch(self, batch_id: str) -> None:
        """The batch and its lines, in one transaction; its files stay (they expire at their own time)."""
        self._tx([("DELETE FROM lines WHERE batch_id = ?", (batch_id,)),
                  ("DELETE FROM batches WHERE id = ?", (batch_id,))])

    def batch_totals(self) -> list[dict]:
        """For each status that batches are in: `n` batches, and their lines `unanswered`, `completed` and
        `failed`, summed (/metrics reads these, never the lines)."""
        return self._rows("SELECT status, COUNT(*) AS n, COALESCE(SUM(total - completed - failed), 0) AS unanswered, "
                          "COALESCE(SUM(completed), 0) AS completed, COALESCE(SUM(failed), 0) AS failed FROM batches "
                          "GROUP BY status")

    def fail_validation(self, batch_id: str, errors: list[dict]) -> None:
        self._tx([("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ? AND "
                   "status = 'validating'", (int(time.time()), json.dumps(errors), batch_id))])

    def start_batch(self, batch_id: str, lines: list[Line]) -> None:
        """Validated: its lines stored (pending) and the batch in_progress, in one transaction — a batch killed
        while validating is validated again from its file."""
        stmts = [("DELETE FROM lines WHERE batch_id = ?", (batch_id,))]
        stmts += [("INSERT INTO lines (batch_id, idx, custom_id, url, body) VALUES (?, ?, ?, ?, ?)",
                   (batch_id, ln.idx, ln.custom_id, ln.url, json.dumps(ln.body)))
                  for ln in lines]
        stmts.append(("UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ? WHERE id = ? AND "
                      "status = 'validating'", (int(time.time()), len(lines), batch_id)))
        self._tx(stmts)

    def pending_lines(self, batch_id: str) -> list[Line]:
        rows = self._rows("SELECT idx, custom_id, url, body FROM lines WHERE batch_id = ? AND result IS NULL "
                          "ORDER BY idx", (batch_id,))
        return [Line(r["idx"], r["custom_id"], r["url"], json.loads(r["body"])) for r in rows]

    def finish_line(self, batch_id: str, idx: int, result: dict, ok: bool) -> None:
        """A line's result and the batch's counts, together; a line already finished is left as it was."""
        with self._mutex:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute(
                    "UPDATE lines SET result = ?, ok = ?, done_seq = (SELECT COALESCE(MAX(done_seq), 0) + 1 FROM "
                    "lines WHERE batch_id = ?) WHERE batch_id = ? AND idx = ? AND result IS NULL",
                    (json.dumps(result, ensure_ascii=False), int(ok), batch_id, batch_id, idx))
                if cur.rowcount:
                    col = "completed" if ok else "failed"
                    self._db.execute(f"UPDATE batches SET {col} = {col} + 1 WHERE id = ?", (batch_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def results_since(self, batch_id: str, after: int) -> list[tuple[int, dict]]:
        """The lines of a batch that finished after the `after`-th one, in the order they finished, each with its
        place in that order (pass the last one back as `after`; -1 for all)."""
        rows = [] if after >= 0 else self._rows(
            "SELECT 0 AS seq, result FROM lines WHERE batch_id = ? AND result IS NOT NULL AND done_seq IS NULL "
            "ORDER BY idx", (batch_id,))
        rows += self._rows("SELECT done_seq AS seq, result FROM lines WHERE batch_id = ? AND done_seq > ? "
                           "ORDER BY done_seq", (batch_id, max(after, 0)))
        return [(r["seq"], json.loads(r["result"])) for r in rows]

    def set_status(self, batch_id: str, status: str, when: str | None, only_from: tuple[str, ...]) -> bool:
        """Moves a batch to `status` (stamping the column `when`, unless None) if it is in one of `only_from`;
        True if it moved."""
        stamp, args = (f", {when} = ?", (int(time.time()),)) if when is not None else ("", ())
        with self._mutex:
            cur = self._db.execute(f"UPDATE batches SET status = ?{stamp} WHERE id = ? AND status IN "
                                   f"({_marks(only_from)})", (status, *args, batch_id, *only_from))
            return cur.rowcount > 0

    def choose_output_ids(self, batch_id: str) -> None:
        """Picks the output and error files' ids once: a finalize that is killed and run again writes the same
        files."""
        self._tx([("UPDATE batches SET output_file_id = COALESCE(output_file_id, ?), "
                   "error_file_id = COALESCE(error_file_id, ?) WHERE id = ?",
                   (new_id("file-"), new_id("file-"), batch_id))])

    def finish_batch(self, batch_id: str, status: str, when: str) -> dict:
        """Writes the output file (2xx lines) and the error file (the rest) in input order, then, in one
        transaction, their rows and the batch's final status. A file with no line is not created (its id is
        cleared), as OpenAI leaves output_file_id or error_file_id null."""
        b = self.get_batch(batch_id)
        now = int(time.time())
        stmts: list[tuple[str, tuple]] = []
        for ok, col in ((1, "output_file_id"), (0, "error_file_id")):
            file_id = b[col]
            size = self._write_bytes(file_id, self._result_lines(batch_id, ok))
            if size:
                stmts.append(("INSERT OR IGNORE INTO files VALUES (?, ?, 'batch_output', ?, ?)",
                              (file_id, f"{batch_id}_{'output' if ok else 'error'}.jsonl", size, now)))
            else:
                os.remove(self.file_path(file_id))
                stmts.append((f"UPDATE batches SET {col} = NULL WHERE id = ?", (batch_id,)))
        stmts.append((f"UPDATE batches SET status = ?, {when} = ? WHERE id = ?", (status, now, batch_id)))
        self._tx(stmts)
        return self.get_batch(batch_id)

    def _result_lines(self, batch_id: str, ok: int) -> Iterator[bytes]:
        rows = self._rows("SELECT result FROM lines WHERE batch_id = ? AND ok = ? ORDER BY idx", (batch_id, ok))
        for r in rows:
            yield r["result"].encode() + b"\n"
