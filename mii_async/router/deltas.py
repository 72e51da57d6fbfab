"""Deltas: a request's StreamChunk as the Delta its client receives, and one engine step's Deltas gathered into
one frame per client.

A step may carry tokens of many requests of one client: they leave as one DeltaBatch (one send and one
receive per step instead of one per request), cut every BATCH_BYTES (estimated) or MAX_BATCH_DELTAS. A Delta
with prompt logprobs (up to MAX_PROMPT_LOGPROBS_BYTES) takes a frame of its own, after the client's Deltas
queued before it, so that the order of a client's Deltas is kept. A Delta with logprobs carries the texts of
the tokens they name: at most one entry per vocabulary token (a few MiB for the largest vocabularies, beside
the prompt logprobs' MAX_PROMPT_LOGPROBS_BYTES within the frame's 16 MiB).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .. import protocol as P
from ..outputs import StreamChunk

# A DeltaBatch is sent once its deltas reach this estimate: first deltas carry their prompt's ids, and a step
# may start hundreds of requests with long (prefix-cached) prompts; the frame limit is 16 MiB.
BATCH_BYTES = 2**20


def to_delta(creq: str, chunk: StreamChunk, prompt_logprobs: P.PromptLogprobs | None = None) -> P.Delta:
    """The Delta that streams `chunk` to the client's request `creq` (the first one carries the prompt's ids).
    The router's RequestState leaves a prompt's logprobs packed: `prompt_logprobs`, set on the Delta as they
    came. The Delta carries the texts of the tokens its logprobs name."""
    lps = texts = None
    named: set[int] = set()
    if chunk.logprobs is not None:
        lps = [lp.to_wire() for lp in chunk.logprobs]
        for lp in chunk.logprobs:
            named.add(lp.token_id)
            named.update(i for i, _ in lp.top)
    if prompt_logprobs is not None and chunk.prompt_token_ids is not None:
        # the prompt's ids (its echo shows the first, which has no logprobs) and every alternative's, made
        # distinct with numpy on the packed bytes: n ids a position, mostly repeats, and no object per entry
        named.update(chunk.prompt_token_ids)
        named.update(np.unique(np.frombuffer(prompt_logprobs.top_ids, "<u4")).tolist())
    if lps is not None or prompt_logprobs is not None:
        assert chunk.token_texts is not None, "a chunk with logprobs comes with its tokenizer's texts"
        texts = chunk.token_texts.subset(named)
    return P.Delta(req_id=creq, text=chunk.text, token_ids=list(chunk.token_ids), logprobs=lps,
                   finish_reason=chunk.finish_reason, usage=chunk.usage.to_dict() if chunk.usage is not None else None,
                   error=chunk.error, prompt_ids=chunk.prompt_token_ids, prompt_logprobs=prompt_logprobs,
                   token_texts=texts)


def frame(deltas: list[P.Delta]) -> P.Delta | P.DeltaBatch:
    """One frame for a client: its Delta, or a DeltaBatch of several."""
    return deltas[0] if len(deltas) == 1 else P.DeltaBatch(deltas=deltas)


def delta_bytes(d: P.Delta) -> int:
    """A Delta's frame size, roughly: 4 bytes a token id, the text, ~24 bytes a logprob entry, ~16 a token's
    text, the rest (a Delta with prompt logprobs goes in a frame of its own)."""
    ids = len(d.token_ids) + (len(d.prompt_ids) if d.prompt_ids is not None else 0)
    lps = sum(3 + len(x[1]) for x in d.logprobs) if d.logprobs else 0
    texts = len(d.token_texts) if d.token_texts is not None else 0
    return 64 + 4 * ids + 4 * len(d.text) + 24 * lps + 16 * texts


class StepFrames:
    """One step's Deltas, by client, handed to `send(peer, frame)` as frames: on `close()` (once the step is
    read), or as soon as a client's batch is full."""

    def __init__(self, send: Callable[[bytes, P.Message], None]) -> None:
        self._send = send
        self._queued: dict[bytes, tuple[list[P.Delta], list[int]]] = {}   # client → (deltas, [estimated bytes])

    def add(self, peer: bytes, d: P.Delta) -> None:
        deltas, size = self._queued.setdefault(peer, ([], [0]))
        deltas.append(d)
        size[0] += delta_bytes(d)
        if size[0] >= BATCH_BYTES or len(deltas) >= P.MAX_BATCH_DELTAS:
            del self._queued[peer]
            self._send(peer, frame(deltas))

    def alone(self, peer: bytes, d: P.Delta) -> None:
        """A Delta in a frame of its own (one with prompt logprobs), after the client's Deltas queued so far."""
        if (queued := self._queued.pop(peer, None)) is not None:
            self._send(peer, frame(queued[0]))
        self._send(peer, d)

    def close(self) -> None:
        """Sends every client's queued Deltas."""
        queued, self._queued = self._queued, {}
        for peer, (deltas, _) in queued.items():
            self._send(peer, frame(deltas))
