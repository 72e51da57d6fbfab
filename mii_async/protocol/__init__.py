"""Every wire message between client, router and workers, and their one msgpack encoding.

`client` holds the client ⇄ router hop, `worker` the router ⇄ worker hop, `codec` the frame format, its
limits and checks. Callers use the package: `from mii_async import protocol as P`, then
`P.encode(P.Abort(req_id=...))`. Every message is built by keyword only.
"""
from __future__ import annotations

from typing import Union

from ..packed import PromptLogprobs
from .client import Abort, Delta, DeltaBatch, ErrorReply, Generate, Query, QueryReply
from .codec import (_TYPES, MAX_BATCH_DELTAS, MAX_FRAME_BYTES, MAX_ITEMS, MAX_PROMPT_LOGPROBS_BYTES,
                    PROTOCOL_VERSION, FrameTooLarge, ProtocolError, decode, encode)
from .worker import (ENGINE_COUNTERS, AbortRequest, AddRequest, Assign, Heartbeat, Hello, LoadFailed, Ready,
                     RequestFailed, Shutdown, StatsQuery, StatsReport, StepTokens)

Message = Union[Generate, Abort, Delta, DeltaBatch, ErrorReply, Query, QueryReply, Hello, Assign, LoadFailed,
                StatsQuery, StatsReport, AddRequest, AbortRequest, StepTokens, Ready, Heartbeat, RequestFailed,
                Shutdown]

__all__ = ["ENGINE_COUNTERS", "MAX_BATCH_DELTAS", "MAX_FRAME_BYTES", "MAX_ITEMS", "MAX_PROMPT_LOGPROBS_BYTES",
           "PROTOCOL_VERSION", "Abort", "AbortRequest", "AddRequest", "Assign", "Delta", "DeltaBatch", "ErrorReply",
           "FrameTooLarge", "Generate", "Heartbeat", "Hello", "LoadFailed", "Message", "PromptLogprobs",
           "ProtocolError", "Query", "QueryReply", "Ready", "RequestFailed", "Shutdown", "StatsQuery", "StatsReport",
           "StepTokens", "decode", "encode",
           "_TYPES"]   # every message type by name, for the fuzz tests
