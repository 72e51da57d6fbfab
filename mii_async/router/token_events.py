"""A StepTokens entry as the event RequestState reads, its logprobs checked first and decoded into a Logprob.

A replica is trusted with its token ids, not with the shape of what it sends beside them: a sampled token's
logprobs and a prompt's logprobs are checked against what the request asked for and the replica's vocabulary
before a client sees them, and a malformed entry ends only its request. A prompt's logprobs are checked on
their packed bytes (numpy, a few passes) and go to the client as they came.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .. import protocol as P
from ..outputs import FinishReason, Logprob
from ..params import MAX_TOKEN_ID, SamplingParams


class TokenEvent(NamedTuple):      # what RequestState.on_event reads from a sampled token
    token_id: int
    logprobs: Logprob | None
    finish_reason: FinishReason | None
    cached_tokens: int
    prompt_logprobs: P.PromptLogprobs | None   # on the first token, when asked: checked, still packed


def token_event(msg: P.StepTokens, i: int, params: SamplingParams, prompt_len: int,
                vocab_size: int) -> TokenEvent | None:
    """Entry `i` of `msg` for a request of `params` and a prompt of `prompt_len` tokens, served by a replica of
    `vocab_size` tokens; None when its logprobs are malformed or were not asked for."""
    lp = msg.logprobs[i] if msg.logprobs is not None else None
    plp = msg.prompt_logprobs[i] if msg.prompt_logprobs is not None else None
    if lp is not None and (lp := logprob_entry(msg.token_ids[i], lp, params.logprobs or 0, vocab_size)) is None:
        return None
    if plp is not None and (params.prompt_logprobs is None or (plp := prompt_logprobs(
            plp, prompt_len, params.prompt_logprobs, vocab_size)) is None):
        return None
    return TokenEvent(msg.token_ids[i], lp, msg.finish_reasons[i], msg.cached_tokens[i], plp)


def well_formed(msg: P.StepTokens) -> bool:
    """Its parallel lists are as long as its req_ids."""
    n = len(msg.req_ids)
    return len(msg.token_ids) == len(msg.finish_reasons) == len(msg.cached_tokens) == n and (
        msg.logprobs is None or len(msg.logprobs) == n) and (
        msg.prompt_logprobs is None or len(msg.prompt_logprobs) == n)


def logprob_entry(token_id: int, x: Any, n: int, vocab_size: int) -> Logprob | None:
    """A worker's logprob entry for `token_id` (Logprob.to_wire(): [logprob, [[id, logprob], …], rank]) with
    at most `n` alternatives, decoded; None when malformed: finite numbers (JSON carries no inf or nan), ids
    that are token ids, a rank in 1 … vocabulary (or None)."""
    try:
        lp, top, rank = x
        if not _finite(lp) or not isinstance(top, (list, tuple)) or len(top) > n or not (
                rank is None or (type(rank) is int and 1 <= rank <= vocab_size)):
            return None
        for i, v in top:
            if type(i) is not int or not 0 <= i <= MAX_TOKEN_ID or not _finite(v):
                return None
    except (TypeError, ValueError):
        return None
    return Logprob.from_wire(token_id, x)


def _finite(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def prompt_logprobs(x: Any, prompt_len: int, n: int, vocab_size: int) -> P.PromptLogprobs | None:
    """A StepTokens entry's prompt logprobs, or None when malformed: PromptLogprobs of one position per prompt
    token after the first, at most `n` alternatives, finite numbers (JSON carries no inf or nan), ids inside
    the vocabulary, ranks in 1 … vocabulary. Checked with numpy on the packed bytes, which then go to the client
    as they came."""
    if type(x) is not P.PromptLogprobs or not x.n <= n or x.num_positions != prompt_len - 1:
        return None                                # (decode checked the shape: lengths agree with n)
    own = np.frombuffer(x.own, "<f4")
    lps = np.frombuffer(x.top_logprobs, "<f4")
    if not (np.isfinite(own).all() and np.isfinite(lps).all()):
        return None
    if lps.size and int(np.frombuffer(x.top_ids, "<u4").max()) >= vocab_size:
        return None
    ranks = np.frombuffer(x.ranks, "<u4")
    if ranks.size and not (int(ranks.min()) >= 1 and int(ranks.max()) <= vocab_size):
        return None
    return x
