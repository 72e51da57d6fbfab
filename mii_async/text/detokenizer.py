"""Incremental detokenization for streaming: UTF-8 safe deltas and stop strings.

The router receives a request's sampled token ids a step at a time and must turn them into text deltas that,
concatenated, equal what a full `tokenizer.decode(generated_ids)` gives — without re-decoding the whole output
on every step. Two layers, one object per request:

1. Token window (the vLLM/TGI `prefix_offset`/`read_offset` technique). `ids[prefix_offset:read_offset]` is the
   last chunk already turned into text; `ids[read_offset:]` are ids not yet turned into text. Each push decodes
   the window with and without the pending ids and emits the difference, so the cost is proportional to the new
   ids, and decoders that treat a sequence's first token specially (SentencePiece strips its leading space)
   see the same context that full decoding would. While the decoded window ends in U+FFFD, a multi-byte
   character is (probably) split across tokens and the pending ids are held back. A byte-fallback tokenizer
   (SentencePiece's `<0xHH>` tokens, byte_runs.py) decodes a run of byte tokens as a whole, all U+FFFD if
   any byte is invalid, so there the run that ends the ids is held back until it ends or turns invalid.
2. Stop strings, on characters. Text from layer 1 is held back while a suffix of it could still grow into a
   stop string, so a partial stop string never reaches the client; a complete match ends the request.
   Matches are taken from the id that reaches min_new_tokens on, however the ids are batched into pushes. The id
   that ended a request (EOS or a stop id: `push(..., stop_terminated=True)`) adds no text unless
   include_stop_str_in_output, as in vLLM.

The tokenizer is duck-typed (anything with a transformers-style `decode`), so this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from .byte_runs import Utf8, byte_runs, utf8_state
from .token_bytes import TokenSpeller

# How many prompt ids seed the window: enough context for the first generated token to decode exactly as it
# would after the prompt (leading space, byte merges), few enough that seeding costs nothing.
PROMPT_CONTEXT_IDS = 5
# A character is at most 4 UTF-8 bytes, so at most 4 byte-bearing tokens are split across; a window still
# ending in U+FFFD after this many pending ids holds a genuinely invalid byte, not a split character. Past this
# bound the stable part is released, which keeps each push O(new ids) even for a model that samples garbage.
MAX_PENDING_IDS = 8
# When releasing past MAX_PENDING_IDS, the last ids stay pending: they show whether the text before them is final.
KEEP_PENDING_IDS = 4
# Byte-fallback tokenizers (byte_runs.py): a valid run of byte tokens is held back whole, since a later invalid
# byte turns the whole run into U+FFFD; past this many ids its complete characters are shown, and a run that
# then turns invalid streams them where a full decode shows U+FFFD. A window starting inside an invalid run
# must reach back to an invalid byte, at most this far; past it (an invalid byte followed by this many valid
# bytes, with no other token between) the rest of the run streams as valid text. Both bound the cost per id.
MAX_HELD_RUN_IDS = 32

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """The one method used: transformers' `PreTrainedTokenizer(Fast).decode`."""

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool, clean_up_tokenization_spaces: bool
               ) -> str: ...


def _backend_decode(tokenizer: Tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """A transformers fast tokenizer whose decoding nothing in its class customizes is its `tokenizers`
    backend's decode plus an optional space clean-up, which we turn off: call the backend directly (1 µs against
    3 µs a call; the router decodes twice per token). None for any other tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    mro = type(tokenizer).__mro__
    owner = {name: next((c.__name__ for c in mro if name in c.__dict__), None) for name in ("decode", "_decode")}
    if owner != {"decode": "PreTrainedTokenizerBase", "_decode": "TokenizersBackend"} and \
            owner != {"decode": "PreTrainedTokenizerBase", "_decode": "PreTrainedTokenizerFast"}:
        return None
    return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class Delta(NamedTuple):
    text: str  # new text safe to show now (may be "")
    stopped: bool  # a stop string was matched: the request must end, finish_reason "stop"
    stop_str: str | None  # the matched stop string, or None


class IncrementalDetokenizer:
    """Turns one request's generated ids into streamable text. Not thread-safe; one per request.

    Invariant: `text` + held-back text (`_held` and the text of `ids[read_offset:]`) is what a full decode of
    the generated ids gives so far, except that a split character is represented only once completed.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], *, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_new_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._fast = _backend_decode(tokenizer, skip_special_tokens)
        self._runs = byte_runs(tokenizer, skip_special_tokens)
        self._stop = tuple(s for s in stop if s)  # "" would match everywhere; validation happens upstream
        self._include_stop = include_stop_str_in_output
        # Stop strings are looked for once this many ids are generated, in text decoded from then on (as vLLM
        # does; the sampler holds back EOS and stop ids as long)
        self._min_new_tokens = min_new_tokens
        self._generated = 0

        context = list(prompt_ids[-PROMPT_CONTEXT_IDS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: generated bytes would merge with it, and the output would
            # no longer be the decode of the generated ids alone. Start without context instead.
            context = []
        if self._runs is not None and self._runs.trailing_run(context, 0) < len(context):
            # The prompt ends in byte tokens: generated bytes would extend its run (and could turn its
            # characters into U+FFFD). Start without context, as above.
            context = []
        self._ids: list[int] = context  # prompt context + generated ids
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # ids before this are already turned into text
        self._held = ""  # decoded text not yet emitted: it may be the start of a stop string
        self._pieces: list[str] = []  # everything emitted, in order
        self._stopped = False  # a stop string was matched
        self._stop_str: str | None = None
        self._finished = False  # stopped or flushed: no more input is accepted

    @property
    def text(self) -> str:
        """All text emitted so far (held-back text that `flush` would add is not included)."""
        return "".join(self._pieces)

    @property
    def stop_str(self) -> str | None:
        """The stop string matched, by a push or in the text a flush released; None if none was."""
        return self._stop_str

    def push(self, token_ids: Sequence[int], *, stop_terminated: bool = False) -> Delta:
        """Feed newly generated ids (one or more); return the text that became safe to show.

        `stop_terminated`: the last id ended the request (EOS or a stop id; the engine's finish reason "stop").
        Its text is left out unless include_stop_str_in_output, as vLLM does (a stop id such as "." or a shown
        "<|im_end|>" is not part of the answer); it still counts as generated. `flush` is expected next."""
        assert not self._finished, "push() after the request stopped or was flushed"
        start = self._min_new_tokens - self._generated   # the ids before the one reaching min_new_tokens
        if self._stop and 1 < start and len(token_ids) > 1:
            # Stop strings are looked for in text released from the id that reaches min_new_tokens on: the ids
            # before it go one at a time (none can stop), so that which text counts as earlier does not depend
            # on how the ids are batched (a split character's bytes release text only once complete, and an
            # id's text would wait for a later id of its push that ends in a split character).
            n = min(start - 1, len(token_ids) - 1)
            first = "".join(self.push(token_ids[k:k + 1]).text for k in range(n))
            rest = self.push(token_ids[n:], stop_terminated=stop_terminated)
            return Delta(first + rest.text, rest.stopped, rest.stop_str)
        self._generated += len(token_ids)
        if stop_terminated and not self._include_stop:
            token_ids = token_ids[:-1]
        self._ids.extend(token_ids)
        return self._emit(self._decode_pending(final=False))

    def flush(self, *, drop_incomplete: bool = False) -> str:
        """At the end of a request not stopped by a stop string: return all held-back text.

        Ids still pending are decoded as they are, so an invalid byte sequence at the very end shows as U+FFFD,
        exactly as in a full decode. A stop string completed by that last text still truncates it.
        `drop_incomplete` (a request cut by max_new_tokens): a character that the last ids began and no id
        finished is left out, not shown as U+FFFD (its tokens still count as generated); bytes already invalid
        show as U+FFFD all the same.
        """
        if self._finished:
            return ""
        if drop_incomplete and self._runs is not None:
            self._cut_unfinished_run()
        pending = self._ids[self._read_offset:]
        text = self._decode_pending(final=True)
        if drop_incomplete and self._runs is None and text.endswith(REPLACEMENT_CHAR) and self._unfinished(pending):
            text = text[:-1]      # an unfinished character decodes as one U+FFFD (a lossy UTF-8 decode's rule)
        delta = self._emit(text)
        self._finished = True
        if delta.stopped:
            return delta.text
        rest, self._held = self._held, ""
        if rest:
            self._pieces.append(rest)
        return delta.text + rest

    # ---- layer 1: ids → text -------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _decode_pending(self, *, final: bool) -> str:
        """Text of the pending ids that is final now (all of it when `final`), advancing the window."""
        ids, prefix, read = self._ids, self._prefix_offset, self._read_offset
        if read == len(ids):
            return ""
        if self._runs is not None:
            return self._decode_pending_runs(final=final)
        prefix_text = self._decode(ids[prefix:read])
        new_text = self._decode(ids[prefix:])
        # Assumed of every decoder that concatenates token texts (byte-level BPE, SentencePiece): decoding more
        # ids only extends the text, once the window's text ends on a whole character.
        if final or (len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)):
            self._prefix_offset, self._read_offset = read, len(ids)
            return new_text[len(prefix_text):]
        if len(ids) - read <= MAX_PENDING_IDS:
            return ""  # a character is split across tokens, or nothing new to show yet
        # Past here: many pending ids, so keep the window short.
        if new_text == prefix_text:
            # The pending ids show no text at all in context (skipped special tokens): dropping them changes no
            # later decode, since decode drops them too.
            del ids[read:]
            return ""
        # The text still ends in U+FFFD: release the part before the last few ids once they show it is final.
        # If decoding more ids leaves `mid_text` in place and adds text after it, a truncated sequence at its end
        # was broken (a completed one would have replaced its U+FFFD), so no later id can change it.
        split = len(ids) - KEEP_PENDING_IDS
        mid_text = self._decode(ids[prefix:split])
        if not (mid_text.startswith(prefix_text) and new_text.startswith(mid_text) and len(new_text) > len(mid_text)):
            return ""
        self._prefix_offset, self._read_offset = read, split
        return mid_text[len(prefix_text):]

    def _decode_pending_runs(self, *, final: bool) -> str:
        """`_decode_pending` for a byte-fallback tokenizer: text before the run of byte tokens that ends the ids
        is final (no split characters elsewhere), the run's own text only once it is invalid (then every byte
        is one U+FFFD for good) or ended; windows never start inside a run that could still decode otherwise."""
        ids, prefix, read, runs = self._ids, self._prefix_offset, self._read_offset, self._runs
        assert runs is not None
        cut, start = len(ids), runs.trailing_run(ids, prefix)
        invalid = start < cut and utf8_state(runs.run_bytes(ids[start:])) is Utf8.INVALID
        if not final and start < cut and not invalid:
            cut = start if cut - start <= MAX_HELD_RUN_IDS else runs.complete_end(ids, start)
        if cut <= read:
            return ""
        prefix_text = self._decode(ids[prefix:read])
        text = self._decode(ids[prefix:cut])
        if not final and len(text) <= len(prefix_text):
            # Nothing shown yet (skipped special tokens): keep the window on text, so that a decoder that
            # strips the first token's space strips the same one as a full decode; drop a long stretch.
            if text == prefix_text and cut - read > MAX_PENDING_IDS:
                del ids[read:cut]
            return ""
        new_prefix = read
        if invalid and start < read:
            # `read` lies inside an invalid run: the next window must start where its bytes are invalid too,
            # or it would decode a valid tail of the run as text where the full decode shows U+FFFD.
            q = runs.invalid_from(ids, max(start, read - MAX_HELD_RUN_IDS), read, cut)
            new_prefix = read if q is None else q
        self._prefix_offset, self._read_offset = new_prefix, cut
        return text[len(prefix_text):]

    def _cut_unfinished_run(self) -> None:
        """Byte fallback: drops the byte tokens of an unfinished character that ends a run valid so far (decoded
        whole, the run would be one U+FFFD per byte). An invalid run was shown as it came: it stays."""
        ids, runs = self._ids, self._runs
        assert runs is not None
        start = runs.trailing_run(ids, self._prefix_offset)
        if start < len(ids) and utf8_state(runs.run_bytes(ids[start:])) is Utf8.INCOMPLETE:
            del ids[max(runs.complete_end(ids, start), self._read_offset):]

    def _unfinished(self, pending: list[int]) -> bool:
        """Whether the bytes of `pending` (ids the decoder shows) end inside a character; False where the
        tokenizer's bytes are not known (no `tokenizers` backend)."""
        speller = TokenSpeller.of(self._tokenizer)
        if speller is None:
            return False
        skipped = {i for i, t in speller.added.items() if t.special} if self._skip_special_tokens else set()
        data = b"".join(speller.spell(i) for i in pending if i not in skipped)
        # the last character's lead byte is among the last 4 bytes; after it, continuation bytes only
        lead = next((k for k in range(len(data) - 1, max(len(data) - 5, -1), -1) if not 0x80 <= data[k] < 0xC0), None)
        return lead is not None and utf8_state(data[lead:]) is Utf8.INCOMPLETE

    # ---- layer 2: stop strings -----------------------------------------------------------------------

    def _emit(self, new_text: str) -> Delta:
        """Append decoded text behind the held text; emit what can no longer become part of a stop string."""
        pending = self._held + new_text
        if not self._stop:
            self._held = ""
            return self._delta(pending)
        if self._generated >= self._min_new_tokens:
            # Every earlier push found no complete match and held back any suffix that could start one, so a
            # match lies wholly in `pending`. Take the match that completes first, as if the text arrived a
            # character at a time, so the result is the same however the ids are batched into pushes; among
            # matches completing at the same character, the one starting earliest ("\n\nUser:" over "User:").
            best: tuple[int, int, str] | None = None  # (end, start, stop string)
            for s in self._stop:
                start = pending.find(s)
                if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                    best = (start + len(s), start, s)
            if best is not None:
                end, start, s = best
                self._held = ""
                self._stopped = self._finished = True
                self._stop_str = s
                return self._delta(pending[:end] if self._include_stop else pending[:start], s)
        # (before min_new_tokens no match is taken, but a suffix that may start one is held all the same: a
        # stop string that starts before the threshold and ends after it stops the request, as in vLLM)
        keep = self._partial_stop_len(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return self._delta(pending[:len(pending) - keep])

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _delta(self, text: str, stop_str: str | None = None) -> Delta:
        if text:
            self._pieces.append(text)
        return Delta(text, stop_str is not None, stop_str)
