"""DeepSpeed-MII's generation keywords on our API: the ones we take, the one we honour our own way
(`max_length`), and the ones we cannot honour, each refused naming the nearest supported parameter.

DeepSpeed-MII 0.3's `generate` takes max_length, max_new_tokens, min_new_tokens, ignore_eos,
return_full_text, do_sample, top_p, top_k, temperature and stop: all but max_length are ours by the same name
and meaning. `max_length` bounds prompt + output tokens; the prompt's length is known once the router has
tokenized it (the first streamed chunk carries its ids), so the request asks the router for at most
max_length - 1 new tokens within the room the context leaves (fit_context), and `cap_length` ends the stream
at max_length tokens in all, with finish_reason "length" (the rest is aborted at the router).
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from .errors import InvalidParameterError
from .outputs import FinishReason, StreamChunk, Usage

# Keywords of DeepSpeed-MII, transformers' generate and OpenAI that we cannot honour → (why, the nearest one).
UNSUPPORTED: dict[str, tuple[str, str]] = {
    "num_beams": ("beam search is not implemented", "do_sample=False (greedy decoding)"),
    "early_stopping": ("beam search is not implemented", "do_sample=False (greedy decoding)"),
    "length_penalty": ("beam search is not implemented", "do_sample=False (greedy decoding)"),
    "num_return_sequences": ("one answer per prompt", "the prompt given several times, each with its own seed"),
    "no_repeat_ngram_size": ("n-gram blocking is not implemented", "repetition_penalty"),
    "typical_p": ("typical sampling is not implemented", "min_p or top_p"),
    "min_length": ("a bound that counts the prompt is not implemented", "min_new_tokens"),
    "max_tokens": ("OpenAI's name, taken by the gateway's /v1 routes", "max_new_tokens"),
    "stop_sequences": ("another library's name", "stop"),
}
STREAM_KEYWORD = ("streaming is asked by the call, not a keyword",
                  "streaming_fn=callback, or `client.stream(prompt)`")


def check_names(params: dict[str, Any], *, stream_keyword: bool = True) -> None:
    """Refuses a keyword we cannot honour, naming it and the nearest supported one. `stream_keyword`: whether
    `stream` is one of them (the REST body takes `"stream": true` itself)."""
    for name in params:
        why_nearest = UNSUPPORTED.get(name) or (STREAM_KEYWORD if stream_keyword and name == "stream" else None)
        if why_nearest is not None:
            why, nearest = why_nearest
            raise InvalidParameterError(name, f"not supported ({why}); the nearest supported parameter is {nearest}")


def check_max_length(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise InvalidParameterError("max_length", f"must be an integer of at least 2 (prompt and output tokens in "
                                    f"all), got {value!r}")
    return value


def length_request(params: dict[str, Any], max_length: int) -> dict[str, Any]:
    """The parameters to send for a request bounded by `max_length` tokens in all: max_new_tokens no more
    than max_length - 1 (the prompt has a token at least); the router fits it to the context (fit_context)."""
    out = dict(params)
    asked = out.get("max_new_tokens")
    ceiling = max_length - 1
    out["max_new_tokens"] = min(asked, ceiling) if isinstance(asked, int) and not isinstance(asked, bool) \
        else ceiling if asked is None else asked            # a bad value is SamplingParams' to name
    return out


async def cap_length(chunks: AsyncIterator[StreamChunk], max_length: int) -> AsyncIterator[StreamChunk]:
    """Passes `chunks` through until prompt + output reach `max_length` tokens; that chunk ends the stream with
    finish_reason "length" and the rest is closed (aborted at the router). A prompt of `max_length` tokens or
    more is an InvalidParameterError naming max_length."""
    left: int | None = None
    prompt_len = generated = 0
    try:
        async for c in chunks:
            if left is None:
                prompt_len = len(c.prompt_token_ids or ())
                left = max_length - prompt_len
                if left < 1:
                    raise InvalidParameterError("max_length", f"{max_length} tokens leave no room for output after "
                                                f"the prompt's {prompt_len}")
            if c.finish_reason is not None or len(c.token_ids) < left:
                left -= len(c.token_ids)
                generated += len(c.token_ids)
                yield c
                if c.finish_reason is not None:
                    return
                continue
            # This chunk reaches the bound: a step brings one token a request, so the cut is at a chunk's end.
            ids = c.token_ids[:left]
            generated += len(ids)
            yield StreamChunk(c.text, ids, c.logprobs[:left] if c.logprobs else c.logprobs, FinishReason.LENGTH,
                              Usage(prompt_len, generated), None, c.prompt_logprobs, c.prompt_token_ids,
                              c.token_texts)
            return
    finally:
        await chunks.aclose()      # type: ignore[attr-defined]
