"""TokenizerTexts: a vocabulary's TokenTexts, each token decoded at first use and kept.

The router (and the local pipeline) is the one place that holds the tokenizer, so it gives the texts of the
tokens that logprobs name: a Delta carries the table of just those ids (`subset`), and the client and the
gateway decode nothing. Every request of one tokenizer shares one cache (`texts_of`): a prompt's logprobs
name (1 + n) tokens per prompt token, and decoding each on the loop took ~1.7 s for a 39k-token prompt at
n = 20, where a miss costs one decode (~2 µs) and the whole vocabulary, once, ~0.1 s for 49k tokens. No torch.
"""
from __future__ import annotations

import weakref
from typing import Any

from ..outputs import TokenTexts
from .token_bytes import TokenSpeller

MAX_CACHED_TEXTS = 1 << 20   # tokens kept: vocabularies are ~32k–260k; ids outside one must not grow it forever


class TokenizerTexts(TokenTexts):
    """Not thread-safe beyond the GIL: it decodes on the thread that asks (the router's loop, the one that
    runs its detokenizers)."""

    __slots__ = ("tokenizer", "_speller")

    def __init__(self, tokenizer: Any) -> None:
        super().__init__({}, {})
        self.tokenizer = tokenizer
        self._speller: TokenSpeller | None | bool = None   # made at first use; False: the tokenizer has no
                                                           # `tokenizers` backend, a token's bytes are its text's

    def text(self, token_id: int) -> str:
        t = self.texts.get(token_id)
        return t if t is not None else self._learn(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id not in self.texts:
            self._learn(token_id)
        return super().token_bytes(token_id)

    def _learn(self, token_id: int) -> str:
        if len(self.texts) >= MAX_CACHED_TEXTS:
            self.texts.clear()
            self.spelled.clear()
        if self._speller is None:
            self._speller = TokenSpeller.of(self.tokenizer) or False
        t = self.tokenizer.decode([token_id])
        b = self._speller.spell(token_id) if self._speller else None
        if b is not None and b != t.encode():
            self.spelled[token_id] = b
        self.texts[token_id] = t
        return t


_SHARED: weakref.WeakKeyDictionary[Any, TokenizerTexts] = weakref.WeakKeyDictionary()


def texts_of(tokenizer: Any) -> TokenizerTexts:
    """The TokenizerTexts every request of `tokenizer` shares (one that cannot be weakly referenced gets a
    cache of its own each time)."""
    try:
        texts = _SHARED.get(tokenizer)
        if texts is None:
            texts = _SHARED[tokenizer] = TokenizerTexts(tokenizer)
    except TypeError:
        return TokenizerTexts(tokenizer)
    return texts
