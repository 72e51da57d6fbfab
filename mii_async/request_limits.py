"""RequestLimits: what makes a request impossible for a deployment, checked before any engine sees it.

Checked once, where a request is admitted: the router checks with the limits its replicas reported in their
ready handshake, and the local pipeline (which has no router) with its engine's. The engine takes what it is
handed. Imports no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import InvalidParameterError, RequestTooLongError
from .params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int              # token ids must be below this
    max_model_len: int           # prompt + output tokens, the model's (or the configured) context
    max_request_tokens: int      # prompt + output tokens one request may hold: context and whole KV pool

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises an InvalidParameterError naming what makes the request impossible."""
        if not prompt_ids:
            raise InvalidParameterError("prompt", "must hold at least one token")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParameterError("prompt", f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        params.check_vocab(self.vocab_size)
        limit = min(self.max_model_len, self.max_request_tokens)
        if len(prompt_ids) >= limit:              # no max_new_tokens could make it fit: the prompt is the fault
            what = "the model's context" if limit == self.max_model_len else "the KV pool"
            raise RequestTooLongError("prompt", f"the prompt's {len(prompt_ids)} tokens leave no room to generate "
                                      f"within {what} of {limit} tokens")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise RequestTooLongError("max_new_tokens", f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                                      f"({params.max_new_tokens}) exceeds the model's context of {self.max_model_len}")
        if total > self.max_request_tokens:
            raise RequestTooLongError("max_new_tokens", f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                                      f"({params.max_new_tokens}) exceeds the KV pool of {self.max_request_tokens} tokens")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestLimits:
        """The limits a replica's Ready reported. A worker's message is checked like a client's: a missing or
        non-positive-integer field is a ValueError naming it (the router then fails that worker, never itself)."""
        if not isinstance(d, dict):
            raise ValueError("info must be a map")
        values = []
        for name in ("vocab_size", "max_model_len", "max_request_tokens"):
            v = d.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"info.{name} must be a positive integer, got {v!r}")
            values.append(v)
        return cls(*values)

    def merge(self, other: RequestLimits) -> RequestLimits:
        """The limits that hold on both (replicas may size their KV pools differently)."""
        return RequestLimits(min(self.vocab_size, other.vocab_size), min(self.max_model_len, other.max_model_len),
                             min(self.max_request_tokens, other.max_request_tokens))
