"""The client ⇄ router hop: what a client (AsyncClient, the gateway) sends to the router and what comes back.

Ids here are the client's own strings; the router maps them to its request numbers (worker.py's int req_ids).
A client's Shutdown (worker.py) also travels this hop and is answered with a QueryReply.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..outputs import FinishReason, TokenTexts
from ..packed import PromptLogprobs
from .codec import IDS, PROMPT_LOGPROBS, TOKEN_TEXTS, list_of, message


@message
@dataclass(kw_only=True)
class Generate:
    """Client → router: start a request."""
    req_id: str                                    # chosen by the client, unique among its live requests; every
                                                   # Delta or ErrorReply for the request carries it
    prompt: str | None = None                      # text, or None when prompt_ids / messages are given
    prompt_ids: list[int] | None = field(default=None, metadata=IDS)   # token ids, used as they are
    messages: list[dict] | None = None             # chat messages, through the model's chat template
    params: dict = field(default_factory=dict)     # SamplingParams.to_wire() (the client checked them); the
                                                   # router checks them again (from_wire); {}: the defaults
    tools: list[dict] | None = None                # with messages: the functions the prompt shows, each
                                                   # {"type": "function", "function": {"name", "description",
                                                   # "parameters"}}; the router renders them with the chat
                                                   # (text/chat_tools.py); None: none shown
    parallel_tool_calls: bool = True               # with tools: the prompt allows several calls per answer
                                                   # (else at most one, where our own tool section shows them)
    keep_tool_markers: bool = False                # the answer is read for <tool_call> blocks: where the
                                                   # tokenizer holds those markers as special tokens, the router
                                                   # keeps special tokens in the text (skip_special_tokens false)
    fit_context: bool = False                      # params' max_new_tokens is a ceiling: the router lowers it to
                                                   # the room the prompt leaves in the context and the KV pool
                                                   # (the gateway's default for a chat without max_tokens)
    # How the prompt is rendered and tokenized (text/render_options.py RenderOptions, whose fields these are;
    # the router checks them again): the defaults render as before these fields existed.
    chat_template_kwargs: dict | None = None       # with messages: extra variables for the chat template (JSON
                                                   # values; apply_chat_template's own parameter names refused)
    add_generation_prompt: bool = True             # with messages: the prompt ends with the assistant's turn opened
    continue_final_message: bool = False           # with messages: the prompt ends inside the last message, which
                                                   # the answer continues (only with add_generation_prompt false)
    add_special_tokens: bool | None = None         # the tokenizer's special tokens (BOS) around the text; None:
                                                   # true for a text prompt, false for messages (the template
                                                   # writes them); prompt_ids are used as given
    truncate_prompt_tokens: int | None = None      # ≥ 1: only the prompt's last this many tokens are kept (after
                                                   # rendering and tokenizing); None: all


@message
@dataclass(kw_only=True)
class Abort:
    """Client → router: end a request now (its KV blocks are freed within a step)."""
    req_id: str                                    # a live Generate's; an id that is not live is ignored


@message
@dataclass(kw_only=True)
class Delta:
    """Router → client: new text of one request; the last one has finish_reason and usage."""
    req_id: str                                    # the Generate's
    text: str                                      # UTF-8 safe, never a partial stop string
    token_ids: list[int] = field(default_factory=list, metadata=IDS)   # the ids sampled since the last Delta
    logprobs: list | None = None                   # parallel to token_ids, when the request asked for
                                                   # logprobs: Logprob.to_wire() ([logprob, [[id, logprob], …],
                                                   # rank], natural log)
    finish_reason: FinishReason | None = None      # on the last Delta
    usage: dict | None = None                      # prompt_tokens, completion_tokens, cached_tokens
    error: str | None = None                       # with finish_reason "error"
    prompt_ids: list[int] | None = field(default=None, metadata=IDS)   # first delta only: the prompt's ids
    prompt_logprobs: PromptLogprobs | None = field(default=None, metadata=PROMPT_LOGPROBS)   # when asked, on the
                                                   # delta of the first sampled token (which has prompt_ids):
                                                   # one position per prompt token after the first
    token_texts: TokenTexts | None = field(default=None, metadata=TOKEN_TEXTS)   # with logprobs or prompt
                                                   # logprobs: the text (and bytes) of every id they name, and
                                                   # of the prompt's ids with prompt logprobs; the router decodes
                                                   # them, so that no client needs the tokenizer


@message
@dataclass(kw_only=True)
class DeltaBatch:
    """Router → client: the Deltas of one engine step for this client's requests, in one frame (one send and
    one receive per step instead of one per request)."""
    deltas: list[Delta] = field(metadata=list_of(Delta))   # each as a Delta's map, without "v" and "t";
                                                   # at most codec.MAX_BATCH_DELTAS


@message
@dataclass(kw_only=True)
class ErrorReply:
    """Router → client: a request refused before it started (bad parameter, overload, bad frame)."""
    req_id: str | None                             # the refused Generate's or Query's; None when the refusal
                                                   # names none (an unreadable frame, an id already live)
    code: str                                      # "invalid_parameter" | "overloaded" | "bad_frame" | … (the
                                                   # keys of errors.ERROR_CODES: the caller's exception class)
    message: str                                   # for people: what was wrong, naming the value
    param: str | None = None                       # the bad parameter, when there is one


@message
@dataclass(kw_only=True)
class Query:
    """Client → router: a question about the deployment, answered by a QueryReply with the same req_id."""
    req_id: str                                    # chosen by the client, unique among its pending queries
    what: str                                      # "ping" | "health" | "stats" | "reset_prefix_cache"


@message
@dataclass(kw_only=True)
class QueryReply:
    """Router → client."""
    req_id: str                                    # the Query's, or a client Shutdown's
    result: dict                                   # ping: {"live": the asker's live req_ids}; health: state and
                                                   # replicas; stats: per replica; Shutdown: {"state": "draining"}
