"""Admission: whether the router takes a new request, and if not, the error that says why.

Two moments. On arrival (before the prompt is encoded): the deployment must be ready, fewer than
`max_queued_requests` requests may be live, the sampling parameters must be valid, exactly one of prompt,
prompt_ids and messages must be given, tools only with messages, and a text or chat must not hold more characters
than any tokenizer fits in the replicas' context (text/prompts.py's bound: encoding megabytes takes seconds,
refusing them takes microseconds). Once encoded (the prompt's ids are known): a replica must be ready, a request
that asks to fit the context has max_new_tokens lowered to the room its prompt leaves, the request must fit the
replicas' limits (vocabulary, context, KV pool), its prompt logprobs must fit one message, and its cost (prompt +
max_new_tokens) must fit `max_queued_tokens` beside the queued ones. Each refusal is an exception from errors.py
whose message names the parameter or the bound at fault. No state of its own.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from .. import protocol as P
from ..errors import InvalidParameterError, OverloadedError, RequestTooLongError, UnavailableError
from ..packed import prompt_logprobs_bytes
from ..params import SamplingParams
from ..request_limits import RequestLimits
from ..text.prompts import check_prompt_size

Prompt = Any   # str | list[int] (token ids) | list[dict] (chat messages)


class Arrival(NamedTuple):   # what a Generate asks for, checked
    params: SamplingParams
    prompt: Prompt


class Admitted(NamedTuple):  # an encoded request that may go to a replica
    params: SamplingParams   # as checked on arrival, max_new_tokens fitted to the context when asked
    cost: int                # prompt + max_new_tokens, counted against max_queued_tokens


class Admission:
    def __init__(self, max_queued_requests: int, max_queued_tokens: int) -> None:
        self.max_queued_requests = max_queued_requests   # live requests, encoding ones included
        self.max_queued_tokens = max_queued_tokens       # dispatched requests' prompt + max_new_tokens, summed

    def on_arrival(self, msg: P.Generate, state: str, live: int, limits: RequestLimits | None) -> Arrival:
        """Checks a Generate before its prompt is encoded. `state`: the router's; `live`: its live requests;
        `limits`: the ready replicas' (None: none is ready, and the encoded request is refused for that)."""
        if state != "ready":
            raise UnavailableError(f"the deployment is {state}")
        if live >= self.max_queued_requests:
            raise OverloadedError(f"overloaded: {live} requests queued "
                                  f"(max_queued_requests={self.max_queued_requests})")
        params = SamplingParams.from_wire(msg.params)
        given = [x for x in (msg.prompt, msg.prompt_ids, msg.messages) if x is not None]
        if len(given) != 1:
            raise InvalidParameterError("prompt", "give exactly one of prompt, prompt_ids and messages")
        if msg.tools is not None and msg.messages is None:
            raise InvalidParameterError("tools", "tools go with a chat: give the prompt as messages")
        if limits is not None:
            check_prompt_size(given[0], msg.tools, min(limits.max_model_len, limits.max_request_tokens))
        return Arrival(params, given[0])

    def on_encoded(self, ids: list[int], params: SamplingParams, limits: RequestLimits | None,
                   queued_tokens: int, fit_context: bool = False) -> Admitted:
        """Checks an encoded request against the ready replicas' `limits` (None: no replica is ready) and the
        tokens already queued. `fit_context`: max_new_tokens is a ceiling, lowered to the room the prompt leaves
        (a prompt that leaves none is refused by the limits, naming it)."""
        if limits is None:
            raise UnavailableError("no replica is ready")
        if fit_context:
            params = fit_to_context(len(ids), params, limits)
        limits.check(ids, params)
        check_prompt_logprobs_size(len(ids), params)
        cost = len(ids) + params.max_new_tokens
        if queued_tokens + cost > self.max_queued_tokens:
            raise OverloadedError(f"overloaded: {queued_tokens} tokens queued, this request adds {cost} "
                                  f"(max_queued_tokens={self.max_queued_tokens})")
        return Admitted(params, cost)


def fit_to_context(num_tokens: int, params: SamplingParams, limits: RequestLimits) -> SamplingParams:
    """`params` with max_new_tokens at most the room a prompt of `num_tokens` leaves in the context and the KV
    pool: OpenAI's default for a chat without max_tokens. A min_new_tokens past that room is refused, named."""
    room = min(limits.max_model_len, limits.max_request_tokens) - num_tokens
    if 1 <= room < params.max_new_tokens:
        return dataclasses.replace(params, max_new_tokens=room)
    return params


def check_prompt_logprobs_size(num_tokens: int, params: SamplingParams) -> None:
    """A request's prompt logprobs travel in one message (with its first token): refuses those that cannot."""
    n = params.prompt_logprobs
    if n is not None and prompt_logprobs_bytes(num_tokens, n) > P.MAX_PROMPT_LOGPROBS_BYTES:
        raise RequestTooLongError("prompt_logprobs", f"the logprobs of a prompt of {num_tokens} tokens with {n} "
                                  f"alternatives each exceed the {P.MAX_PROMPT_LOGPROBS_BYTES >> 20} MiB that one "
                                  "message carries: ask for fewer alternatives or give a shorter prompt")
