"""Stored responses of the Responses API (`store: true`): what GET /v1/responses/{id} answers and what a later
request's `previous_response_id` continues.

ResponseStore is the interface the routes use; every value in it is plain JSON (a response object, the chat
messages of its conversation), so that a durable store (SQLite) can keep the same records as text.
MemoryResponseStore keeps them in this gateway's memory, bounded by count and by bytes (their JSON's size):
the least recently used go first, and a response no longer kept is answered as one that never was (404).
Several gateways in front of one router do not share it. Not thread-safe: the gateway's event loop owns it.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, NamedTuple, Protocol

MAX_STORED_RESPONSES = 4096
MAX_STORED_BYTES = 256 << 20      # their JSON, responses and conversations together


class StoredResponse(NamedTuple):
    response: dict[str, Any]        # the response object, as POST answered it
    conversation: list[dict[str, Any]]   # the chat messages its answer ends (input turns, the answer's turn),
                                    # without its instructions, which a continuation does not inherit


class ResponseStore(Protocol):
    def put(self, response_id: str, record: StoredResponse) -> None:
        """Keeps `record` under `response_id` (replacing one kept there)."""

    def get(self, response_id: str) -> StoredResponse | None:
        """The record kept under `response_id`, or None."""

    def delete(self, response_id: str) -> bool:
        """Forgets `response_id`; whether it was kept."""


class MemoryResponseStore:
    """A ResponseStore in memory: at most `max_count` records and `max_bytes` of their JSON; the least
    recently used (put or got) are dropped first. One record larger than `max_bytes` is not kept."""

    def __init__(self, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        assert max_count > 0 and max_bytes > 0, "a store's bounds are positive"
        self.max_count, self.max_bytes = max_count, max_bytes
        self._records: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()   # oldest use first
        self.bytes = 0                  # the JSON size of every record kept

    def put(self, response_id: str, record: StoredResponse) -> None:
        size = len(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode())
        self.delete(response_id)
        if size > self.max_bytes:
            return
        self._records[response_id] = (record, size)
        self.bytes += size
        while len(self._records) > self.max_count or self.bytes > self.max_bytes:
            _, (_, dropped) = self._records.popitem(last=False)
            self.bytes -= dropped

    def get(self, response_id: str) -> StoredResponse | None:
        kept = self._records.get(response_id)
        if kept is None:
            return None
        self._records.move_to_end(response_id)
        return kept[0]

    def delete(self, response_id: str) -> bool:
        kept = self._records.pop(response_id, None)
        if kept is None:
            return False
        self.bytes -= kept[1]
        return True

    def __len__(self) -> int:
        return len(self._records)
