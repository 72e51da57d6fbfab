"""Byte runs of a SentencePiece-style byte-fallback tokenizer, for the incremental detokenizer.

A byte-fallback vocabulary spells characters it lacks as byte tokens `<0x00>`…`<0xFF>`, and the `tokenizers`
ByteFallback decoder turns each maximal run of consecutive byte tokens into its UTF-8 text, or, when the run's
bytes are not valid UTF-8 anywhere in it, into one U+FFFD per byte: `<0xE4><0xBD><0xA0>` is "你", but
`<0xE4><0xBD><0xA0><0x80>` is four U+FFFD. So a later byte can change the text of a character already
completed, and a window that starts inside a run can decode differently from the whole output. Byte-level BPE
decoders (GPT-2's) are lossy per invalid sequence instead and need none of this.

Special tokens that decoding skips do not end a run (they are dropped before the decoder sees the tokens), nor
do ids past the tokenizer's vocabulary (a model's padded embedding rows), which decoding drops too.
Imports no torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from enum import Enum
from typing import Any


class Utf8(Enum):
    COMPLETE = 0  # valid UTF-8 made of whole characters
    INCOMPLETE = 1  # valid so far, ends inside a character
    INVALID = 2  # contains an error no later byte can repair


def utf8_state(data: bytes) -> Utf8:
    try:
        data.decode("utf-8")
        return Utf8.COMPLETE
    except UnicodeDecodeError as exc:
        # The first error is reported; "unexpected end of data" at the very end is a truncated character.
        return Utf8.INCOMPLETE if exc.end == len(data) and exc.reason == "unexpected end of data" else Utf8.INVALID


class ByteRuns:
    """Where a byte-fallback tokenizer's byte runs lie in a list of ids, for one `skip_special_tokens`."""

    def __init__(self, byte_of: dict[int, int], skipped: frozenset[int], n_vocab: int) -> None:
        self.byte_of = byte_of  # id of a byte token → its byte
        self.skipped = skipped  # ids decoding drops (special tokens, when skip_special_tokens) below n_vocab
        self.n_vocab = n_vocab  # ids from here on are unknown to the tokenizer: decoding drops them

    def _in_run(self, i: int) -> bool:
        return i in self.byte_of or i in self.skipped or i >= self.n_vocab

    def trailing_run(self, ids: Sequence[int], lo: int) -> int:
        """Start of the run of byte tokens that ends `ids` (skipped ids inside it), not before `lo`;
        len(ids) when ids do not end in a byte token (skipped ids aside)."""
        start = end = len(ids)
        while start > lo and self._in_run(ids[start - 1]):
            start -= 1
        while start < end and ids[start] not in self.byte_of:  # the run starts at its first byte
            start += 1
        return start

    def run_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(self.byte_of[i] for i in ids if i in self.byte_of)

    def complete_end(self, ids: Sequence[int], start: int) -> int:
        """For a valid run `ids[start:]`: the index just after its last complete character (`start` if none)."""
        end = len(ids)
        while end > start and utf8_state(self.run_bytes(ids[start:end])) is not Utf8.COMPLETE:
            end -= 1
        return end

    def invalid_from(self, ids: Sequence[int], lo: int, hi: int, end: int) -> int | None:
        """The largest q in [lo, hi] whose bytes ids[q:end] are INVALID (so every later extension of that
        run decodes as one U+FFFD per byte, as the whole run does); None if there is none."""
        for q in range(hi, lo - 1, -1):
            if utf8_state(self.run_bytes(ids[q:end])) is Utf8.INVALID:
                return q
        return None


_Found = tuple[dict[int, int], frozenset[int], int]
_cache: weakref.WeakKeyDictionary[Any, _Found | None] = weakref.WeakKeyDictionary()


def byte_runs(tokenizer: Any, skip_special_tokens: bool) -> ByteRuns | None:
    """ByteRuns for a fast tokenizer whose decoder has the whole-run ByteFallback behaviour; None otherwise."""
    try:
        found = _cache[tokenizer]
    except KeyError:
        found = _probe(tokenizer)
        _cache[tokenizer] = found
    except TypeError:  # not weak-referenceable
        found = _probe(tokenizer)
    if found is None:
        return None
    byte_of, special, n_vocab = found
    return ByteRuns(byte_of, special if skip_special_tokens else frozenset(), n_vocab)


def _probe(tokenizer: Any) -> _Found | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    byte_of = {}
    for b in range(256):
        i = backend.token_to_id(f"<0x{b:02X}>")
        if i is not None:
            byte_of[i] = b
    if len(byte_of) != 256:
        return None
    by_byte = {b: i for i, b in byte_of.items()}
    # "你" followed by a stray continuation byte: whole-run semantics turn all four bytes into U+FFFD
    probe = [by_byte[b] for b in "你".encode()] + [by_byte[0x80]]
    if backend.decode(probe, skip_special_tokens=False) != "\ufffd" * 4:
        return None
    special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    return byte_of, special, backend.get_vocab_size(with_added_tokens=True)
