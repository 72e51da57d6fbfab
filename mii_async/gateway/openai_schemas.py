"""Request bodies of the OpenAI-compatible routes (pydantic). Unknown fields are refused, as OpenAI does;
fields that OpenAI defines but we do not implement are accepted only at their neutral value (checked in
openai_params.py). The extensions after the OpenAI fields follow vLLM's names.

Every model is strict, as OpenAI's API is: `"max_tokens": "5"`, `true` or `5.0` for an integer, and `1` or
`"true"` for a boolean, are 400s naming the field, not coerced (an int is still a valid float)."""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict

_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _Common(BaseModel):
    model_config = _STRICT
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
    # vLLM-style extensions
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
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    reasoning_effort: Optional[str] = None
    modalities: Optional[list[str]] = None
