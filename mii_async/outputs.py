"""What a caller gets back: a Response per finished request, a StreamChunk per streamed step.

Field names follow DeepSpeed-MII's Response (generated_text, prompt_length, generated_length, finish_reason),
with token ids, logprobs, prompt logprobs and usage added.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0           # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "cached_tokens": self.cached_tokens}


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # (token id, logprob), best first
    rank: int | None = None      # the token's rank at its position, sampled or prompt (1: the most likely; as
                                 # likely counts before it); None where not known

    def to_dict(self) -> dict[str, Any]:
        """JSON's form (the gateway's REST and WebSocket answers): top as [[id, logprob], …]; rank when known."""
        out = {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}
        if self.rank is not None:
            out["rank"] = self.rank
        return out


@dataclass
class StreamChunk:
    """One streamed step of a request. The last chunk has `finish_reason` and `usage` set. With
    `prompt_logprobs` asked, the chunk of the first sampled token (the first chunk, unless the request ended
    before any token) carries them; every other chunk has None."""

    text: str                                   # new text, UTF-8 safe, never a partial stop string
    token_ids: list[int]                        # tokens sampled since the previous chunk
    logprobs: list[Logprob] | None = None       # one per token when asked
    finish_reason: str | None = None            # "stop" | "length" | "abort" | "error" on the last chunk
    usage: Usage | None = None
    error: str | None = None                    # the message when finish_reason == "error"
    prompt_logprobs: list[Logprob | None] | None = None   # as Response.prompt_logprobs, on one chunk only
    prompt_token_ids: list[int] | None = None   # the first chunk only: the prompt's ids (as the engine got them)


@dataclass
class Response:
    generated_text: str
    prompt_length: int                          # prompt tokens
    generated_length: int                       # generated tokens
    finish_reason: str                          # "stop" | "length" | "abort" | "error"
    token_ids: list[int] = field(default_factory=list)        # the generated ids
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    usage: Usage | None = None
    error: str | None = None
    # With prompt_logprobs=n: one entry per prompt token, None for the first (nothing comes before it), each
    # other the token's logprob given the tokens before it and the n most likely tokens there. None when not
    # asked, or when the request ended before its first token.
    prompt_logprobs: list[Logprob | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"generated_text": self.generated_text, "prompt_length": self.prompt_length,
                "generated_length": self.generated_length, "finish_reason": self.finish_reason}

    def __str__(self) -> str:
        return self.generated_text
