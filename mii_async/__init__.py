"""mii_async: asyncio streaming LLM inference.

`import mii_async` pulls in neither torch nor cupy: the engine is imported when a pipeline starts.
"""
from __future__ import annotations

from .api import pipeline
from .errors import (EngineClosedError, GenerationError, InvalidParameterError, MIIAsyncError, ModelNotFoundError,
                     RequestTooLongError, UnsupportedModelError)
from .outputs import Response, StreamChunk
from .params import SamplingParams

__version__ = "0.1.0"
__all__ = ["pipeline", "Response", "StreamChunk", "SamplingParams", "MIIAsyncError", "InvalidParameterError",
           "RequestTooLongError", "ModelNotFoundError", "UnsupportedModelError", "EngineClosedError",
           "GenerationError", "__version__"]
