"""Public entry points."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .local_pipeline import Pipeline


def pipeline(model: str | None = None, **kwargs: Any) -> Pipeline:
    """Loads `model` (None: the default SmolLM2-135M-Instruct) in this process and returns a Pipeline.

    `model` is an HF directory, a repo id in the local HF cache, or a .gguf file. Keyword arguments are
    engine options (dtype, device, max_model_len, cache_dir, block_size, num_blocks, kv_cache_memory,
    enable_prefix_caching, max_batch_tokens, max_num_seqs); an unknown one raises InvalidParameterError.
    """
    from .config import EngineConfig
    from .local_pipeline import Pipeline

    return Pipeline(EngineConfig.from_kwargs(model, **kwargs))
