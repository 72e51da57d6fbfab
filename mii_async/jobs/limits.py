"""JobLimits: the bounds of the Files and Batches API on one gateway."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidParameterError

COMPLETION_WINDOWS = {"24h": 24 * 3600}    # OpenAI accepts this one window only


@dataclass(frozen=True)
class JobLimits:
    max_file_bytes: int = 200 << 20    # an uploaded file (OpenAI's bound); the gateway's max_body_bytes (8 MiB by
                                       # default) bounds the upload's body first
    max_lines: int = 50_000            # request lines in one batch's input file (OpenAI's bound)
    max_in_flight: int = 8             # batch lines running at once on this gateway, all batches together

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "max_lines", "max_in_flight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidParameterError(name, f"must be a positive integer, got {v!r}")
