"""Tests' way to write a prompt's logprobs in their packed wire form (protocol.PromptLogprobs) from values."""
from __future__ import annotations

import array
import sys

from mii_async import protocol as P


def _le(typecode: str, values: list) -> bytes:
    a = array.array(typecode, values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def pack(entries: list, n: int, ranks: list[int] | None = None) -> P.PromptLogprobs:
    """`entries`: per position after the first, (logprob, [(id, logprob)] × n); float32 on the wire. `ranks`:
    each position's prompt token's rank (default 1 + the alternatives more likely than its logprob)."""
    assert all(len(top) == n for _, top in entries), "every position has the n alternatives"
    if ranks is None:
        ranks = [1 + sum(v > lp for _, v in top) for lp, top in entries]
    return P.PromptLogprobs(n, _le("f", [lp for lp, _ in entries]),
                            _le("I", [i for _, top in entries for i, _ in top]),
                            _le("f", [v for _, top in entries for _, v in top]), _le("I", ranks))


def raw(n, own: list, top_ids: list, top_logprobs: list, ranks: list | None = None) -> P.PromptLogprobs:
    """Any arrays, whether they agree or not (a malformed entry); ranks default to 1 per position."""
    return P.PromptLogprobs(n, _le("f", own), _le("I", top_ids), _le("f", top_logprobs),
                            _le("I", [1] * len(own) if ranks is None else ranks))
