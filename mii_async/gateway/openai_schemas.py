"""Request bodies of the OpenAI-compatible routes (pydantic). Unknown fields are refused, as OpenAI does, unless
the gateway runs with --lenient-requests (vLLM's behaviour): then an unknown top-level field is dropped, with a
warning logged once per field name. Fields that OpenAI defines but we do not implement are accepted only at
their neutral value (checked in openai_params.py). The extensions after the OpenAI fields follow vLLM's names.

Every model is strict, as OpenAI's API is: `"max_tokens": "5"`, `true` or `5.0` for an integer, and `1` or
`"true"` for a boolean, are 400s naming the field, not coerced (an int is still a valid float)."""
from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any, Optional, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger("mii_async.gateway")
_STRICT = ConfigDict(extra="forbid", strict=True)
# The config of the gateway whose request is being validated: set by `lenient_requests`, a dependency of the
# routes, which FastAPI solves before it validates the body, in the request's own context.
_CONFIG: ContextVar[Any] = ContextVar("gateway_config", default=None)
_warned: set[str] = set()          # the unknown field names already logged


async def lenient_requests(request: Request) -> None:
    """The routes' dependency: the gateway's HttpConfig, whose lenient_requests decides what an unknown field
    does (read only when a body has one)."""
    _CONFIG.set(request.app.state.gateway.config)


def _lenient() -> bool:
    # strict wherever the config carries no lenient_requests (an HttpConfig that does not offer it)
    return bool(getattr(_CONFIG.get(), "lenient_requests", False))


class Body(BaseModel):
    """A request body: strict, unknown fields refused (or, lenient, dropped and logged once per name)."""
    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = {f.alias or name for name, f in cls.model_fields.items()}
        unknown = [k for k in data if k not in known]
        if not unknown or not _lenient():
            return data
        for name in unknown:
            if name not in _warned:
                _warned.add(name)
                log.warning("lenient requests: ignoring the unknown request field %r (logged once)", name)
        return {k: v for k, v in data.items() if k in known}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: the guided fields under their new names."""
    model_config = _STRICT
    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json")   # guided_json
    regex: Optional[str] = None                       # guided_regex
    choice: Optional[list[str]] = None                # guided_choice
    json_object: Optional[bool] = None                # any JSON object (OpenAI's JSON mode)
    grammar: Optional[str] = None                     # refused: no grammar engine (regular languages only)
    structural_tag: Optional[Union[str, dict[str, Any]]] = None   # refused, as grammar
    whitespace_pattern: Optional[str] = None          # refused: our JSON guide's whitespace is fixed
    disable_any_whitespace: Optional[bool] = None     # refused, as whitespace_pattern
    disable_additional_properties: Optional[bool] = None   # refused: a schema says so itself
    disable_fallback: Optional[bool] = None           # accepted: one guided-decoding backend, no fallback


class _Common(Body):
    model: Optional[str] = None
    temperature: Optional[float] = None       # OpenAI's default: 1
    top_p: Optional[float] = None
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    # OpenAI's fields that label a request and change no output
    metadata: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    store: Optional[bool] = None              # false only: nothing is stored
    service_tier: Optional[str] = None        # one tier serves every request
    # vLLM-style extensions
    priority: Optional[int] = None     # vLLM's: waiting requests run lower numbers first, then by arrival
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    prompt_logprobs: Optional[int] = None     # each prompt token's logprob and the top n (not with stream)
    guided_grammar: Optional[str] = None      # refused: no grammar engine
    structured_outputs: Optional[StructuredOutputs] = None
    allowed_token_ids: Optional[list[int]] = None
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: Optional[bool] = None # completions: true by default; chat: false (the template has them)
    return_tokens_as_token_ids: Optional[bool] = None   # logprobs' tokens as "token_id:{id}"


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    reasoning_effort: Optional[str] = None    # given to the chat template, as vLLM does
    verbosity: Optional[str] = None           # given to the chat template, as vLLM does
    modalities: Optional[list[str]] = None
    # vLLM's chat extensions: how the prompt is rendered (text/render_options.py), and echo
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    echo: Optional[bool] = False              # the answer starts with the last message's content (an assistant's)


class ResponsesRequest(Body):
    """POST /v1/responses (responses_routes.py). Fields of OpenAI's that we do not implement are accepted at
    their neutral value only (checked there)."""
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None         # a system message before the input (not carried to the next turn)
    previous_response_id: Optional[str] = None
    store: Optional[bool] = True
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None        # OpenAI's default: 1
    top_p: Optional[float] = None
    text: Optional[dict[str, Any]] = None      # {"format": {"type": "text" | "json_object" | "json_schema", …},
                                               # "verbosity"}
    tools: Optional[list[dict[str, Any]]] = None   # function tools: {"type": "function", "name", "description",
                                               # "parameters", "strict"}
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, Any]] = None   # include_obfuscation: accepted, no obfuscation is added
    include: Optional[list[str]] = None        # "message.output_text.logprobs" only
    top_logprobs: Optional[int] = None
    reasoning: Optional[dict[str, Any]] = None # its effort goes to the chat template, as chat's reasoning_effort
    verbosity: Optional[str] = None            # to the chat template, as text.verbosity
    truncation: Optional[str] = None           # "disabled" (the default) or "auto" (the oldest turns dropped)
    background: Optional[bool] = None          # false only
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    # vLLM's extensions
    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
