"""What a caller gets back: a Response per finished request, a StreamChunk per streamed step.

Field names follow DeepSpeed-MII's Response (generated_text, prompt_length, generated_length, finish_reason),
with token ids, logprobs, prompt logprobs and usage added. A Logprob is one shape from the sampler to the
caller; the texts of the tokens it names come from whoever holds the tokenizer (the router, the local
pipeline) as a TokenTexts, so that no consumer decodes token ids itself.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class FinishReason(str, Enum):
    """Why a request ended. A str: it compares, hashes, formats and serializes (JSON, msgpack) as its value."""
    STOP = "stop"           # EOS, a stop id or a stop string
    LENGTH = "length"       # max_new_tokens, or the context
    ABORT = "abort"         # the caller aborted it, or the deployment stopped
    ERROR = "error"         # it failed (the chunk's `error` says why)

    # str's own, not Enum's: str() and format() give the value on every Python (3.12 changed Enum's format of
    # mixins), and the hash is the value's, so that a member finds its string in a set or a dict.
    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__


class TokenTexts:
    """How tokens show, by id: each one's text (decode([id]): a token that holds part of a character shows
    U+FFFD) and its bytes (joined, they spell the output even there). Over the wire a table of exactly the ids
    that a Delta's logprobs, prompt logprobs and (with prompt logprobs) prompt name; in the router and the
    local pipeline the whole vocabulary's, decoded at first use (text/token_texts.py)."""

    __slots__ = ("texts", "spelled")

    def __init__(self, texts: dict[int, str], spelled: dict[int, bytes] | None = None) -> None:
        self.texts = texts                  # token id → its text
        self.spelled = spelled if spelled is not None else {}   # token id → its bytes, only where they are
                                            # not its text's UTF-8 (part of a character, a SentencePiece ▁)

    def text(self, token_id: int) -> str:
        return self.texts[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        b = self.spelled.get(token_id)
        return b if b is not None else self.text(token_id).encode()

    def subset(self, ids: Iterable[int]) -> TokenTexts:
        """The table of these ids alone (what a Delta carries)."""
        text, spelled = self.text, self.spelled
        texts = {i: text(i) for i in ids}          # (first: a vocabulary's table learns them here)
        return TokenTexts(texts, {i: b for i in texts if (b := spelled.get(i)) is not None})

    def __len__(self) -> int:
        return len(self.texts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenTexts):
            return NotImplemented
        return self.texts == other.texts and self.spelled == other.spelled

    def __repr__(self) -> str:
        return f"TokenTexts({len(self.texts)} tokens)"


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


@dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # (token id, logprob), best first
    rank: int | None = None      # the token's rank at its position, sampled or prompt (1: the most likely; as
                                 # likely counts before it); None where not known
    # The texts of token_id and of top's ids: set by whoever holds the tokenizer (the router, the local
    # pipeline); None in the engine. Not compared: it follows from the ids.
    token_texts: TokenTexts | None = field(default=None, compare=False, repr=False)

    @property
    def text(self) -> str | None:
        """The token's text (decode([id])), where the texts are known."""
        return None if self.token_texts is None else self.token_texts.text(self.token_id)

    @property
    def token_bytes(self) -> bytes | None:
        """The token's bytes (OpenAI's chat `bytes`), where the texts are known."""
        return None if self.token_texts is None else self.token_texts.token_bytes(self.token_id)

    @property
    def top_texts(self) -> list[str] | None:
        """The texts of `top`'s tokens, in its order."""
        t = self.token_texts
        return None if t is None else [t.text(i) for i, _ in self.top]

    @property
    def top_bytes(self) -> list[bytes] | None:
        t = self.token_texts
        return None if t is None else [t.token_bytes(i) for i, _ in self.top]

    def to_dict(self) -> dict[str, Any]:
        """JSON's form (the gateway's REST and WebSocket answers): top as [[id, logprob], …]; rank when known."""
        out = {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}
        if self.rank is not None:
            out["rank"] = self.rank
        return out

    def to_wire(self) -> list:
        """The one wire form of a token's logprobs, in a StepTokens (worker → router) and a Delta (router →
        client): [logprob, [[id, logprob], …], rank or None]. The token's id is the message's parallel
        token_ids entry; the texts travel beside, in the Delta's token_texts."""
        return [self.logprob, [list(t) for t in self.top], self.rank]

    @classmethod
    def from_wire(cls, token_id: int, x: list, token_texts: TokenTexts | None = None) -> Logprob:
        """`to_wire`'s entry `x` for the token `token_id`, as it came: the router checks a worker's entries
        before (router/token_events.py), a client trusts its router's."""
        logprob, top, rank = x
        return cls(token_id, logprob, [(i, v) for i, v in top], rank, token_texts)


@dataclass
class StreamChunk:
    """One streamed step of a request. The last chunk has `finish_reason` and `usage` set. With
    `prompt_logprobs` asked, the chunk of the first sampled token (the first chunk, unless the request ended
    before any token) carries them; every other chunk has None."""

    text: str                                   # new text, UTF-8 safe, never a partial stop string
    token_ids: list[int]                        # tokens sampled since the previous chunk
    logprobs: list[Logprob] | None = None       # one per token when asked
    finish_reason: FinishReason | None = None   # on the last chunk
    usage: Usage | None = None
    error: str | None = None                    # the message when finish_reason == "error"
    prompt_logprobs: list[Logprob | None] | None = None   # as Response.prompt_logprobs, on one chunk only
    prompt_token_ids: list[int] | None = None   # the first chunk only: the prompt's ids (as the engine got them)
    # With logprobs or prompt logprobs: the texts of the tokens they name, and (with prompt logprobs) of the
    # prompt's ids, whose first has no Logprob (the echo of a prompt shows it); else None
    token_texts: TokenTexts | None = field(default=None, compare=False, repr=False)


@dataclass
class Response:
    generated_text: str
    prompt_length: int                          # prompt tokens
    generated_length: int                       # generated tokens
    finish_reason: FinishReason
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
