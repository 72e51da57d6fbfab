"""mii_async: asyncio streaming LLM inference and serving over a ZeroMQ worker mesh.

`import mii_async` pulls in neither torch nor cupy: the engine is imported when a pipeline or a worker starts.
"""
from __future__ import annotations

from .api import client, mii_query_handle, pipeline, serve
from .async_client import AsyncClient
from .errors import (EngineClosedError, GenerationError, InvalidParameterError, MIIAsyncError, ModelNotFoundError,
                     OverloadedError, PermissionDeniedError, RequestTooLongError, UnavailableError,
                     UnsupportedModelError)
from .outputs import FinishReason, Response, StreamChunk, Usage
from .params import SamplingParams

__version__ = "0.1.0"
__all__ = ["pipeline", "serve", "client", "mii_query_handle", "AsyncClient", "FinishReason", "Response", "StreamChunk",
           "Usage", "SamplingParams", "MIIAsyncError", "InvalidParameterError", "RequestTooLongError",
           "ModelNotFoundError", "UnsupportedModelError", "EngineClosedError", "GenerationError", "OverloadedError",
           "PermissionDeniedError", "UnavailableError", "__version__"]
