"""JobLimits: the bounds of the Files and Batches API on one gateway, and the checks that refuse what goes past
them, each naming its bound (the gateway answers them as 413 or 400; docs/jobs.md "Limits")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidParameterError

if TYPE_CHECKING:
    from ..config import HttpConfig

COMPLETION_WINDOWS = {"24h": 24 * 3600}    # OpenAI accepts this one window only
DAY_S = 24 * 3600


@dataclass(frozen=True)
class JobLimits:
    max_file_bytes: int = 200 << 20    # an uploaded file (OpenAI's bound); the gateway's max_body_bytes (8 MiB by
                                       # default) bounds the upload's body first
    max_lines: int = 50_000            # request lines in one batch's input file (OpenAI's bound)
    max_in_flight: int = 8             # batch lines running at once on this gateway, all batches together
    max_stored_bytes: int = 10 << 30   # the bytes of every stored file together, uploads and batch results; an
                                       # upload that would pass it is refused (results are always written)
    retention_s: int = 30 * DAY_S      # a file without expires_after, or a batch that has ended, is deleted this
                                       # long after it was created (OpenAI keeps batch files 30 days)
    sweep_interval_s: float = 3600.0   # how often expired files and batches are looked for (and at each start)

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "max_lines", "max_in_flight", "max_stored_bytes", "retention_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidParameterError(name, f"must be a positive integer, got {v!r}")
        v = self.sweep_interval_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise InvalidParameterError("sweep_interval_s", f"must be a positive number of seconds, got {v!r}")

    @classmethod
    def from_config(cls, http: HttpConfig) -> JobLimits:
        """The limits an HttpConfig sets (its jobs_* fields; None keeps the default here)."""
        given = {"max_file_bytes": http.jobs_max_file_bytes, "max_lines": http.jobs_max_lines,
                 "max_stored_bytes": http.jobs_max_stored_bytes, "retention_s": http.jobs_retention_s}
        return cls(**{k: v for k, v in given.items() if v is not None})


class JobLimitError(InvalidParameterError):
    """A request past one of JobLimits' bounds. `limit` names the JobLimits field, `code` is the API's error code
    and `status` the HTTP status that answers it."""

    def __init__(self, param: str, message: str, *, limit: str, code: str, status: int) -> None:
        super().__init__(param, message)
        self.limit, self.code, self.status = limit, code, status


# Each check's `param` is the parameter the refused request gave the bound's subject in: the HTTP routes' by
# default, `lines` for client.jobs.submit.


def check_file_size(limits: JobLimits, size: int, param: str = "file") -> None:
    if size > limits.max_file_bytes:
        raise JobLimitError(param, f"the file has {size} bytes; max_file_bytes is {limits.max_file_bytes}",
                            limit="max_file_bytes", code="file_too_large", status=413)


def check_room(limits: JobLimits, stored: int, size: int, param: str = "file") -> None:
    """Before a file of `size` bytes is written next to the `stored` bytes already kept."""
    if stored + size > limits.max_stored_bytes:
        raise JobLimitError(param, f"storing this file ({size} bytes) next to the {stored} bytes already stored "
                            f"would pass max_stored_bytes ({limits.max_stored_bytes}); delete files or wait for "
                            "them to expire", limit="max_stored_bytes", code="storage_limit_exceeded", status=413)


def request_line_count(data: bytes) -> int:
    """The request lines of a batch's input file, counted as batch_input.parse_batch_input reads them."""
    return sum(1 for s in data.decode("utf-8", "replace").splitlines() if s.strip())


def check_line_count(limits: JobLimits, lines: int, param: str = "input_file_id") -> None:
    if lines > limits.max_lines:
        raise JobLimitError(param, f"the input file has {lines} request lines; max_lines is "
                            f"{limits.max_lines}", limit="max_lines", code="too_many_lines", status=400)
