"""OpenAI's and vLLM's shapes of logprobs, and what the choices of one prompt share (PromptParts): its echoed
text and its prompt logprobs, rendered once per prompt.

vLLM's return_tokens_as_token_ids shows each token of the answer's logprobs as "token_id:{id}" (its bytes:
that text's), where a token's own text may be part of a character: `as_ids` here, TOKEN_IDS its texts.
"""
from __future__ import annotations

from typing import Any

from ..outputs import Logprob, StreamChunk, TokenTexts
from .state import GatewayState
from .streams import Job, Opened


class TokenIdTexts:
    """Every token's text as "token_id:{id}" (vLLM's return_tokens_as_token_ids), its bytes that text's."""

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> bytes:
        return self.text(token_id).encode()


TOKEN_IDS = TokenIdTexts()


class PromptParts:
    """What the choices of one prompt share, rendered once per prompt: its echoed text and its logprobs, in
    OpenAI's shape (echo) and in vLLM's (prompt_logprobs). The logprobs come from the first chunk of the
    prompt's choice that asked for them (only its first one does: openai_params._jobs); the answers share the
    returned objects, so a caller that changes one copies it first. `as_ids`: return_tokens_as_token_ids.

    The echoed text is the prompt as given, or, cut by truncate_prompt_tokens (or given as token ids), its
    ids as the gateway's tokenizer decodes them (the caller loads it first)."""

    def __init__(self, s: GatewayState, opened: list[Opened], as_ids: bool = False) -> None:
        self.s = s
        self.as_ids = as_ids
        self.firsts: dict[int, StreamChunk] = {}
        self.prompt_ids: dict[int, list[int] | None] = {}   # each prompt's ids, as its first chunk has them
        for o in opened:
            if "prompt_logprobs" in o.job.params:
                self.firsts.setdefault(o.job.prompt_index, o.first)
            self.prompt_ids.setdefault(o.job.prompt_index, o.first.prompt_token_ids)
        self._done: dict[tuple, Any] = {}

    def _once(self, key: tuple, make: Any) -> Any:
        if key not in self._done:
            self._done[key] = make()
        return self._done[key]

    def _first(self, job: Job) -> StreamChunk | None:
        return self.firsts.get(job.prompt_index)

    def text(self, job: Job) -> str:
        return self._once(("text", job.prompt_index), lambda: self._text(job))

    def _text(self, job: Job) -> str:
        if isinstance(job.prompt, str) and not decodes_echo(job):
            return job.prompt
        ids = self.prompt_ids.get(job.prompt_index) or (job.prompt if not isinstance(job.prompt, str) else [])
        return self.s.tokenizer.decode(ids) if self.s.tokenizer is not None else ""

    def echo(self, job: Job, n: int) -> dict:
        return self._once(("echo", job.prompt_index, n), lambda: echo_logprobs(self._first(job), n, self.as_ids))

    def vllm(self, job: Job, n: int) -> list | None:
        return self._once(("vllm", job.prompt_index, n), lambda: vllm_prompt_logprobs(self._first(job), n))


def decodes_echo(job: Job) -> bool:
    """Whether the echo of the job's prompt is its ids decoded (not the text as given): token ids, or a prompt
    cut by truncate_prompt_tokens."""
    render = job.params.get("render")
    return not isinstance(job.prompt, str) or (render is not None and render.truncate_prompt_tokens is not None)


def text_logprobs(lps: list[Logprob | None], offset: int, ids: list[int] | None = None,
                  texts: TokenTexts | None = None, n: int | None = None, as_ids: bool = False) -> dict:
    """The completions API's logprobs: tokens, token_logprobs, top_logprobs, text_offset (each token's start,
    counted from `offset` over the tokens' texts, as vLLM does). An entry without a logprob (a prompt's first
    token) is null in token_logprobs and top_logprobs; its id comes from `ids` (the ids of every entry, when
    given, with `texts`, their chunk's). `n` cuts the top lists (a prompt's may hold more than the completion's
    logprobs asked)."""
    if as_ids:
        tokens = [TOKEN_IDS.text(i) for i in (ids if ids is not None else [lp.token_id for lp in lps])]
    elif ids is None:
        tokens = [lp.text for lp in lps]
    else:
        assert texts is not None, "a prompt's ids come with their chunk's token_texts"
        tokens = [texts.text(i) for i in ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [None if lp is None else _top(lp, t, n, as_ids) for lp, t in zip(lps, tokens)],
            "text_offset": offsets}


def _top(lp: Logprob, token: str, n: int | None, as_ids: bool) -> dict[str, float]:
    """A token's top_logprobs entry: the top n, and the token itself if it is not among them (as OpenAI and
    vLLM: up to logprobs + 1 entries, so logprobs=0 still gives the chosen token's)."""
    assert lp.token_texts is not None, "a chunk's logprobs come with their texts"
    text = TOKEN_IDS.text if as_ids else lp.token_texts.text
    top = {text(i): v for i, v in lp.top[:n]}
    top.setdefault(token, lp.logprob)
    return top


def echo_logprobs(first: StreamChunk | None, n: int, as_ids: bool = False) -> dict:
    """The echoed prompt's part of a choice's logprobs, from the stream's first chunk (OpenAI's echo with
    logprobs: the first prompt token has null logprobs); empty if the request ended before its first token."""
    if first is None or first.prompt_logprobs is None or first.prompt_token_ids is None:
        return text_logprobs([], 0)
    return text_logprobs(first.prompt_logprobs, 0, first.prompt_token_ids, first.token_texts, n, as_ids)


def end_offset(lp: dict) -> int:
    """Where the text after these logprobs' tokens starts."""
    return lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else 0


def extend(lp: dict, more: dict) -> None:
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        lp[key].extend(more[key])


def vllm_prompt_logprobs(first: StreamChunk | None, n: int) -> list | None:
    """vLLM's prompt_logprobs, from the stream's first chunk: null for the first prompt token, then per token
    {id: {"logprob", "rank", "decoded_token"}} for the token itself and the top n (ids as JSON keys are
    strings). The top n's ranks are 1…n; the prompt token's is its rank in the whole vocabulary (the engine
    counts it), or, when it is one of the top n, its place there (as vLLM's dict, whose top n entries come
    last, has it even where the token ties with others). None if the request ended before its first token."""
    if first is None or first.prompt_logprobs is None:
        return None
    out: list[dict | None] = [None]
    assert first.token_texts is not None, "prompt logprobs come with their texts"
    text = first.token_texts.text
    for lp in first.prompt_logprobs[1:]:
        tid = lp.token_id
        top = lp.top[:n]
        rank = lp.rank if lp.rank is not None else next((r for r, (i, _) in enumerate(top, 1) if i == tid), None)
        entry = {str(tid): {"logprob": lp.logprob, "rank": rank, "decoded_token": text(tid)}}
        for r, (i, v) in enumerate(top, 1):
            entry[str(i)] = {"logprob": v, "rank": r, "decoded_token": text(i)}
        out.append(entry)
    return out


def chat_logprobs(lps: list[Logprob], as_ids: bool = False) -> dict:
    """Chat's logprobs: per token its text, logprob and bytes, and its top alternatives alike."""
    return {"content": token_logprobs(lps, as_ids)}


def token_logprobs(lps: list[Logprob], as_ids: bool = False) -> list[dict]:
    """Per token {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, …]} (chat's and
    the Responses API's)."""
    def entry(texts: TokenTexts | TokenIdTexts, token_id: int, logprob: float) -> dict:
        return {"token": texts.text(token_id), "logprob": logprob, "bytes": list(texts.token_bytes(token_id))}

    content = []
    for lp in lps:
        t = TOKEN_IDS if as_ids else lp.token_texts
        assert t is not None, "a chunk's logprobs come with their texts"
        content.append({**entry(t, lp.token_id, lp.logprob), "top_logprobs": [entry(t, i, v) for i, v in lp.top]})
    return content
