"""Packed little-endian arrays on the wire (msgpack bins): token ids as uint32, and a prompt's logprobs
(PromptLogprobs). The router checks and forwards such bytes without making a Python object per element.
Imports no numpy or torch: `import mii_async` stays light."""
from __future__ import annotations

import array
import sys
from itertools import repeat
from typing import Any, NamedTuple

from .outputs import Logprob, TokenTexts


class PromptLogprobs(NamedTuple):
    """A prompt's logprobs, packed: for a prompt of L tokens, positions 1 … L−1 (the first token has none), each
    prompt token's logprob given the tokens before it, its rank there, and the n most likely tokens there. On the
    wire a msgpack array [n, own, top_ids, top_logprobs, ranks] of an int and four bins of little-endian arrays,
    so that the router
    checks them with a few numpy operations and forwards the bytes as they came (a prompt's logprobs as msgpack
    lists cost its event loop ~0.5 s at 4 MiB). `to_logprobs` gives the public form (outputs.Logprob)."""
    n: int                    # alternatives per position (the request's prompt_logprobs, or fewer)
    own: bytes                # float32[L-1]: position p's prompt token's logprob, p = 1 … L-1
    top_ids: bytes            # uint32[(L-1)·n], row-major: position p's n most likely token ids, best first
    top_logprobs: bytes       # float32[(L-1)·n]: their logprobs, parallel to top_ids
    ranks: bytes              # uint32[L-1]: position p's prompt token's rank there (1: the most likely; tokens
                              # as likely count before it, as vLLM ranks)

    @property
    def num_positions(self) -> int:
        return len(self.own) // 4

    def well_formed(self) -> bool:
        """The shape holds together: an int n ≥ 0, four bins, n entries of each top array and one rank per
        position."""
        n, own, ids, lps, ranks = self
        return (type(n) is int and n >= 0 and type(own) is bytes and type(ids) is bytes and type(lps) is bytes
                and type(ranks) is bytes and len(own) % 4 == 0 and len(ids) == len(lps) == n * len(own)
                and len(ranks) == len(own))

    def to_logprobs(self, prompt_ids: list[int], token_texts: TokenTexts | None = None) -> list[Logprob | None]:
        """The public form, one entry per prompt token: None for the first, then Logprob(prompt token, its
        logprob, [(id, logprob), …] best first, its rank, `token_texts`). `prompt_ids` are the prompt's L
        tokens."""
        assert len(prompt_ids) == self.num_positions + 1, "one position per prompt token after the first"
        own = unpack(self.own, "f")
        ids = unpack(self.top_ids, "I")
        lps = unpack(self.top_logprobs, "f")
        n = self.n
        pairs = list(zip(ids, lps))
        tops = [pairs[k:k + n] for k in range(0, len(pairs), n)] if n else [[] for _ in own]
        return [None, *map(Logprob, prompt_ids[1:], own, tops, unpack(self.ranks, "I"), repeat(token_texts))]


def unpack(b: bytes, typecode: str) -> list:
    """A little-endian packed array's values as Python numbers (float32 values are exact as floats)."""
    a = array.array(typecode)
    a.frombytes(b)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def prompt_logprobs_bytes(num_tokens: int, n: int) -> int:
    """An upper bound on the bytes that a prompt of `num_tokens` with prompt_logprobs=`n` adds to a Delta: per
    token its packed id (4), per position after the first its packed logprob and rank (8) and n ids and
    logprobs (8 n), and 40 for the msgpack headers; a StepTokens entry (no prompt ids) is smaller."""
    return num_tokens * (12 + 8 * n) + 40


def pack_ids(ids: list[int]) -> bytes:
    a = array.array("I", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def as_prompt_logprobs(x: Any) -> Any:
    """A wire [n, own, top_ids, top_logprobs, ranks] as PromptLogprobs, when it is one; else x as it came."""
    if type(x) is list and len(x) == 5 and (p := PromptLogprobs(*x)).well_formed():
        return p
    return x
