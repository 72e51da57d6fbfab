"""HttpJobs: a gateway's Files and Batches API over HTTP, for `mii-async batch --target http://…` — the same
methods as JobClient, with the standard library's HTTP client (neither httpx nor openai is a dependency of the
package). The gateway's errors come back as the project's: 4xx naming a parameter → InvalidParameterError, 503 →
UnavailableError, others MIIAsyncError with the gateway's message."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, Iterator

from ..errors import InvalidParameterError, MIIAsyncError, UnavailableError
from .store import TERMINAL

POLL_S = 0.5                 # how often a wait reads the batch
TIMEOUT_S = 120.0            # one HTTP request's limit


class HttpJobs:
    def __init__(self, url: str, api_key: str | None = None) -> None:
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _call(self, method: str, path: str, body: bytes | None = None, content_type: str | None = None) -> bytes:
        headers = dict(self._headers, **({"Content-Type": content_type} if content_type else {}))
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
                return r.read()
        except urllib.error.HTTPError as exc:
            raise _error(exc.code, exc.read()) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UnavailableError(f"the gateway at {self.base} does not answer: {reason}") from None

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        return json.loads(self._call(method, path, data, "application/json" if data is not None else None))

    def submit(self, path: str, endpoint: str, metadata: dict[str, str] | None = None) -> dict:
        """Uploads the JSONL file (purpose batch) and creates its batch; the gateway checks every line."""
        with open(path, "rb") as f:
            data = f.read()
        boundary = uuid.uuid4().hex
        name = urllib.parse.quote(path.rsplit("/", 1)[-1])
        body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
                f'Content-Disposition: form-data; name="file"; filename="{name}"\r\n'
                "Content-Type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
        file = json.loads(self._call("POST", "/files", body, f"multipart/form-data; boundary={boundary}"))
        return self._json("POST", "/batches", {"input_file_id": file["id"], "endpoint": endpoint,
                                               "completion_window": "24h", "metadata": metadata})

    def get(self, batch_id: str) -> dict:
        return self._json("GET", f"/batches/{urllib.parse.quote(batch_id)}")

    def list(self, after: str | None = None, limit: int = 20) -> list[dict]:
        query = urllib.parse.urlencode({"limit": limit, **({"after": after} if after else {})})
        return self._json("GET", f"/batches?{query}")["data"]

    def cancel(self, batch_id: str) -> dict:
        return self._json("POST", f"/batches/{urllib.parse.quote(batch_id)}/cancel")

    def progress(self, batch_id: str) -> Iterator[dict]:
        """The batch now, then after each change of status or counts, until it has ended."""
        last = None
        while True:
            b = self.get(batch_id)
            seen = (b["status"], tuple(b["request_counts"].values()))
            if seen != last:
                last = seen
                yield b
            if b["status"] in TERMINAL:
                return
            time.sleep(POLL_S)

    def results(self, batch_id: str) -> Iterator[dict]:
        """Once the batch has ended: its output file's lines, then its error file's, each in input order (the
        HTTP API gives a batch's lines only as these files)."""
        for b in self.progress(batch_id):
            pass
        for file_id in (b["output_file_id"], b["error_file_id"]):
            if file_id:
                for line in self._call("GET", f"/files/{urllib.parse.quote(file_id)}/content").splitlines():
                    if line.strip():
                        yield json.loads(line)


def _error(status: int, raw: bytes) -> MIIAsyncError:
    try:
        err = json.loads(raw)["error"]
        message, param = str(err.get("message")), err.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param = raw.decode("utf-8", "replace").strip() or "no message", None
    if status == 503:
        return UnavailableError(f"the gateway answered 503: {message}")
    if 400 <= status < 500:
        return InvalidParameterError(param or "request", f"{message} (HTTP {status})")
    return MIIAsyncError(f"the gateway answered {status}: {message}")
