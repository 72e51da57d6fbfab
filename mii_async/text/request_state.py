"""RequestState: one request's consumer side — engine events in, StreamChunks out, a Response at the end.

Engine events are the sampled token (with optional logprobs, the prompt's logprobs on the first one, and the
engine's finish reason) or `Ended` (abort, error). Text goes through the IncrementalDetokenizer, so deltas are
UTF-8 safe and stop strings end the request here: the owner must then abort it in the engine (`needs_abort`).
The first chunk carries the prompt's ids.

Logprobs live in the chunk that carries them. Only an owner that will call `response()` (the local pipeline's
generate) passes `keep_logprobs=True` to have them gathered for the whole request: a prompt's logprobs may be
~100 MB of Python objects (39k tokens × 21 entries), and the router, which only streams, must not hold them for
the request's life.

A prompt's logprobs come packed (protocol.PromptLogprobs). The local pipeline passes `decode_prompt_logprobs`
(implied by keep_logprobs) to have them as Logprob objects in their chunk; the router does not: its chunk has
none, and the packed form waits in `packed_prompt_logprobs` for the owner to take and forward as it came,
without a Python object per position on its loop.

This is where the tokenizer is, so the texts of the tokens that logprobs name are given here: every Logprob
and every chunk with logprobs or prompt logprobs refers to the tokenizer's shared TokenizerTexts
(token_texts.py), from which the router sends a Delta the table of the ids it names. Imports no torch.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import InvalidParameterError
from ..outputs import FinishReason, Logprob, Response, StreamChunk, Usage
from ..params import SamplingParams
from ..protocol import PromptLogprobs
from .detokenizer import IncrementalDetokenizer
from .token_texts import TokenizerTexts, texts_of


class Ended(NamedTuple):
    """The engine ended a request without a token: "abort" or "error" (a FinishReason or its value). `param`:
    an error that is the caller's value, named (a guide the model's vocabulary cannot follow), which refuses a
    request that has sent nothing yet."""
    reason: FinishReason | str
    error: str | None = None
    param: str | None = None


class RequestState:
    def __init__(self, tokenizer: Any, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 keep_logprobs: bool = False, decode_prompt_logprobs: bool = False) -> None:
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=params.stop,
                                             include_stop_str_in_output=params.include_stop_str_in_output,
                                             skip_special_tokens=params.skip_special_tokens,
                                             min_new_tokens=params.min_new_tokens)
        self.output_ids: list[int] = []
        self.keep_logprobs = keep_logprobs      # gather them for response(); else they live in their chunk only
        # both None unless kept: the sampled tokens' (one per token), the prompt's (set by the first token's event)
        self.logprobs: list[Logprob] | None = [] if params.logprobs is not None and keep_logprobs else None
        self.prompt_logprobs: list[Logprob | None] | None = None
        self.decode_prompt_logprobs = decode_prompt_logprobs or keep_logprobs
        # without decode_prompt_logprobs: the prompt's logprobs of the chunk just returned, packed, for its
        # owner to send with that chunk and set back to None
        self.packed_prompt_logprobs: PromptLogprobs | None = None
        # the texts of every token the logprobs name, when any are asked
        self.token_texts: TokenizerTexts | None = None
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.token_texts = texts_of(tokenizer)
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.needs_abort = False          # set when a stop string ended the request before the engine did
        self.cached_tokens = 0
        self._started = False             # a chunk went out (the first one carries the prompt's ids)
        # An Ended with a param before any chunk: the request is refused, as a bad value is at submission;
        # its owner raises this (the router sends it as an ErrorReply) instead of streaming the error chunk.
        self.refusal: InvalidParameterError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_event(self, ev: Any) -> StreamChunk | None:
        """Feeds one engine event; returns the chunk to stream, or None once finished."""
        if self.finished:
            return None
        if isinstance(ev, Ended):
            if ev.param is not None and not self._started:
                self.refusal = InvalidParameterError(ev.param, ev.error or "refused")
            text = self._detok.flush()
            self.finish_reason, self.error = FinishReason(ev.reason), ev.error
            return self._chunk(text, [], None)
        tok: int = ev.token_id
        self.cached_tokens = ev.cached_tokens
        self.output_ids.append(tok)
        lp: Logprob | None = None
        if self.params.logprobs is not None and ev.logprobs is not None:
            lp = ev.logprobs                      # the event's own (the engine's, or the router's decoding)
            lp.token_texts = self.token_texts
            if self.logprobs is not None:
                self.logprobs.append(lp)
        plps, packed = None, False
        if self.params.prompt_logprobs is not None and ev.prompt_logprobs is not None and not self._started:
            # only the first token's event carries them, and it makes the first chunk
            if self.decode_prompt_logprobs:
                plps = ev.prompt_logprobs.to_logprobs(self.prompt_ids, self.token_texts)
                if self.keep_logprobs:
                    self.prompt_logprobs = plps
            else:
                self.packed_prompt_logprobs, packed = ev.prompt_logprobs, True
        # the id that ended it (EOS, a stop id) adds no text unless include_stop_str_in_output, as in vLLM
        delta = self._detok.push([tok], stop_terminated=ev.finish_reason == "stop")
        text = delta.text
        if delta.stopped:
            self.finish_reason = FinishReason.STOP
            self.needs_abort = ev.finish_reason is None
        elif ev.finish_reason is not None:
            # a stop string its text completes wins, as in vLLM; cut by max_new_tokens, a character its last
            # tokens only began is left out (not U+FFFD)
            text += self._detok.flush(drop_incomplete=ev.finish_reason == "length")
            self.finish_reason = FinishReason.STOP if self._detok.stop_str is not None else FinishReason(
                ev.finish_reason)
        return self._chunk(text, [tok], [lp] if lp is not None else None, plps, packed)

    def _chunk(self, text: str, ids: list[int], lps: list[Logprob] | None,
               plps: list[Logprob | None] | None = None, packed: bool = False) -> StreamChunk:
        """`packed`: the chunk's prompt logprobs wait packed in packed_prompt_logprobs (its texts are given all
        the same)."""
        usage = self.usage() if self.finished else None
        first, self._started = not self._started, True
        texts = self.token_texts if lps is not None or plps is not None or packed else None
        return StreamChunk(text, ids, lps, self.finish_reason, usage, self.error, plps,
                           list(self.prompt_ids) if first else None, texts)

    def usage(self) -> Usage:
        return Usage(len(self.prompt_ids), len(self.output_ids), self.cached_tokens)

    def response(self) -> Response:
        assert self.finished, "response() before the request finished"
        if self.refusal is not None:
            raise self.refusal
        assert self.keep_logprobs or (self.params.logprobs is None and self.params.prompt_logprobs is None), \
            "response() with logprobs needs RequestState(keep_logprobs=True)"
        text = self._detok.text
        if self.params.return_full_text and self.prompt is not None:
            text = self.prompt + text
        return Response(text, len(self.prompt_ids), len(self.output_ids), self.finish_reason or FinishReason.ERROR,
                        list(self.output_ids), list(self.prompt_ids), self.logprobs, self.usage(), self.error,
                        self.prompt_logprobs)
