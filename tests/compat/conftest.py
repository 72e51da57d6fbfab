"""Fixtures of the compatibility tests: a tiny random Llama that a deployment can serve (a word tokenizer)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tiny_model, tmp_path_factory) -> Path:
    """A tiny random Llama (transformers' own classes, save_pretrained) with a word-level tokenizer:
    8 attention heads and 4 KV heads, so tensor_parallel=2 splits it."""
    from tests.mesh_helpers import with_word_tokenizer

    return with_word_tokenizer(tiny_model("llama"), tmp_path_factory.mktemp("compat") / "tiny-llama")
