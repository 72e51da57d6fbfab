"""Rows of the store → the File and Batch objects of OpenAI's API, as the `openai` package parses them."""
from __future__ import annotations

import json
from typing import Any

_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "cancelling_at", "cancelled_at",
          "expired_at")
_WITH_FILES = ("completed", "cancelled", "expired")   # the ends after which a batch's result files exist


def file_object(row: dict, expires_at: int | None) -> dict[str, Any]:
    """`expires_at`: when the file is deleted (Expiry.file_expires_at), Unix seconds."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "expires_at": expires_at, "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None}


def batch_object(row: dict) -> dict[str, Any]:
    # The output and error files are named once they exist: their ids are chosen earlier (store.py) so that a
    # finalize run twice writes the same files. An expired batch's exist once expired_at is set (expiry.py).
    done = row["status"] in _WITH_FILES and (row["status"] != "expired" or row["expired_at"] is not None)
    errors = json.loads(row["errors"]) if row["errors"] else None
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"] if done else None,
            "error_file_id": row["error_file_id"] if done else None, "created_at": row["created_at"],
            **{k: row[k] for k in _TIMES}, "expires_at": row["expires_at"],
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None}


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A cursor page (`after`/`limit`), as the `openai` package's SyncCursorPage reads it."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
