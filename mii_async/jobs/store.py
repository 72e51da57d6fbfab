"""JobStore: the durable state of the Files and Batches API — one SQLite database (WAL) and the files' bytes.

Layout of `jobs_dir`:
    jobs.sqlite3        files' metadata, batches, and one row per input line of a batch (its body, then its
                        result once it finished)
    files/<file_id>     each file's bytes, written to a temporary name, fsynced, then renamed into place
    lock                held (flock) by the one gateway process that owns this directory

One writer: the store's single connection is used by the gateway's event loop (the runner and the routes) and
guarded by a lock, so a validation thread may call it too. Each state change is one transaction, so a process
killed at any instant (kill -9) leaves either the line's result committed or the line still pending: on the
next start, pending lines run again and finished ones are never rerun. WAL with synchronous=NORMAL is durable
against a process's death (not a power cut, which may lose the last transactions but never corrupts).
"""
from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import time
import uuid
from typing import Any, Iterator, NamedTuple

from ..errors import InvalidParameterError, UnavailableError

DB_NAME = "jobs.sqlite3"
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
    status TEXT NOT NULL,             -- validating, failed, in_progress, finalizing, completed, cancelling, cancelled
    errors TEXT,                      -- JSON list of {code, message, param, line} when validation failed
    created_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER, expires_at INTEGER NOT NULL,
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
    PRIMARY KEY (batch_id, idx)
) WITHOUT ROWID;
"""
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")   # a runner has work left on these
TERMINAL = ("failed", "completed", "cancelled", "expired")


class Line(NamedTuple):
    idx: int
    custom_id: str
    url: str
    body: dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class JobStore:
    """The database and the files' directory of one `jobs_dir`. `close()` releases the directory's lock."""

    def __init__(self, jobs_dir: str) -> None:
        self.dir = jobs_dir
        self.files_dir = os.path.join(jobs_dir, "files")
        os.makedirs(self.files_dir, exist_ok=True)
        self._lock_fd = os.open(os.path.join(jobs_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # Two gateways running one directory's batches would run each line twice: one owns it. The kernel
            # drops the lock when its holder dies, kill -9 included.
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise UnavailableError(f"jobs_dir {jobs_dir!r} is in use by another gateway process: the Files and "
                                   "Batches API needs a jobs_dir of its own per gateway") from None
        self._db = sqlite3.connect(os.path.join(jobs_dir, DB_NAME), isolation_level=None, check_same_thread=False)
        self._mutex = threading.Lock()
        with self._mutex:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    @staticmethod
    def exists(jobs_dir: str) -> bool:
        return os.path.exists(os.path.join(jobs_dir, DB_NAME))

    def close(self) -> None:
        with self._mutex:
            self._db.close()
        os.close(self._lock_fd)

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

    def add_file(self, filename: str, purpose: str, data: bytes) -> dict:
        """Stores an uploaded file: its bytes first, then its row (a file without a row is never shown)."""
        file_id = new_id("file-")
        size = self._write_bytes(file_id, iter((data,)))
        now = int(time.time())
        self._tx([("INSERT INTO files VALUES (?, ?, ?, ?, ?)", (file_id, filename, purpose, size, now))])
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> dict | None:
        rows = self._rows("SELECT * FROM files WHERE id = ?", (file_id,))
        return rows[0] if rows else None

    def list_files(self, purpose: str | None = None) -> list[dict]:
        """Newest first."""
        if purpose is None:
            return self._rows("SELECT * FROM files ORDER BY created_at DESC, rowid DESC")
        return self._rows("SELECT * FROM files WHERE purpose = ? ORDER BY created_at DESC, rowid DESC", (purpose,))

    def read_file(self, file_id: str) -> bytes:
        with open(self.file_path(file_id), "rb") as f:
            return f.read()

    def delete_file(self, file_id: str) -> bool:
        """Deletes the row, then the bytes; False when there was no such file."""
        if self.get_file(file_id) is None:
            return False
        self._tx([("DELETE FROM files WHERE id = ?", (file_id,))])
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
        return self._rows(f"SELECT * FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))}) ORDER BY seq",
                          ACTIVE)

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
                cur = self._db.execute("UPDATE lines SET result = ?, ok = ? WHERE batch_id = ? AND idx = ? AND "
                                       "result IS NULL", (json.dumps(result, ensure_ascii=False), int(ok),
                                                          batch_id, idx))
                if cur.rowcount:
                    col = "completed" if ok else "failed"
                    self._db.execute(f"UPDATE batches SET {col} = {col} + 1 WHERE id = ?", (batch_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def set_status(self, batch_id: str, status: str, when: str, only_from: tuple[str, ...]) -> bool:
        """Moves a batch to `status` (stamping the column `when`) if it is in one of `only_from`."""
        with self._mutex:
            cur = self._db.execute(
                f"UPDATE batches SET status = ?, {when} = ? WHERE id = ? AND status IN "
                f"({','.join('?' * len(only_from))})", (status, int(time.time()), batch_id, *only_from))
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
