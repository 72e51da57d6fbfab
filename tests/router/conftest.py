"""The router's unit-test fixtures."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A word-level tokenizer of core_harness.VOCAB ids, saved and loaded as a real Hugging Face one."""
    from transformers import AutoTokenizer

    from mii_async.bench.word_tokenizer import save_word_tokenizer
    from tests.router.core_harness import VOCAB

    d = tmp_path_factory.mktemp("words")
    save_word_tokenizer(d, VOCAB)
    return AutoTokenizer.from_pretrained(str(d))
