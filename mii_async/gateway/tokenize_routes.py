"""POST /tokenize and POST /detokenize, with vLLM's bodies: a prompt (text, or chat messages through the chat
template, with the tools it shows) as the router encodes it for /v1/completions and /v1/chat/completions (the
same text layer: text/prompts.py), and token ids back to text. For clients that count tokens without a tokenizer
of their own: a chat page trimming its history to the context, a job service splitting documents. The gateway's
own copy of the model's tokenizer does the work, off the event loop: these are the routes it is loaded for."""
from __future__ import annotations

import asyncio
from typing import Any, Optional

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from ..errors import InvalidParameterError
from ..text.chat_tools import has_tool_calls
from ..text.prompts import PromptEncoder
from .http_errors import HTTPError, bad_request
from .openai_params import chat_messages, plain_messages
from .openai_routes import check_model
from .state import GatewayState
from .text_route import CheckedRoute
from .tool_mode import tool_mode

router = APIRouter(route_class=CheckedRoute)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)   # "5" or true for an int is a 400, as elsewhere
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    tools: Optional[list[dict[str, Any]]] = None    # messages: the tools the chat's prompt shows (as chat's)
    add_special_tokens: Optional[bool] = None       # text: True (as completions); messages: False (the template's)
    add_generation_prompt: Optional[bool] = True    # messages: end with the assistant's turn opened (as chat)
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)   # "5" or true for an int is a 400, as elsewhere
    model: Optional[str] = None
    tokens: list[int]


async def _ready(request: Request, model: str | None) -> GatewayState:
    s: GatewayState = request.app.state.gateway
    check_model(s, model)
    if await s.load_tokenizer() is None:
        raise HTTPError(503, "the gateway has no tokenizer for this model (the router's model directory is not "
                        "on this host)", "service_unavailable_error", code="unavailable")
    return s


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """{"count", "max_model_len", "tokens"} (and "token_strs" with return_token_strs). Exactly one of
    `prompt` and `messages` (with `tools`, as a chat with tool_choice auto shows them); the ids are those the
    generation routes would run."""
    s = await _ready(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt" if body.prompt is None else "messages",
                          "give exactly one of prompt (text) and messages (a chat)")
    tok, encoder = s.tokenizer, PromptEncoder(s.tokenizer)
    if body.tools is not None and body.messages is None:
        raise bad_request("tools", "tools go with messages")
    if body.messages is not None:
        messages = chat_messages(body.messages)
        mode = tool_mode(body.tools, None, None)
        special = bool(body.add_special_tokens)
        agp = bool(body.add_generation_prompt)

        def encode() -> list[int]:
            if mode is not None or has_tool_calls(messages):      # as chat sends tools and tool calls
                text = encoder.render(messages, mode.shown if mode is not None else None,
                                      add_generation_prompt=agp)
            else:
                text = encoder.render(plain_messages(messages), add_generation_prompt=agp)
            return list(tok(text, add_special_tokens=special)["input_ids"])
    else:
        prompt, special = body.prompt, body.add_special_tokens is not False

        def encode() -> list[int]:
            return list(tok(prompt, add_special_tokens=special)["input_ids"])
    try:
        ids = await asyncio.get_running_loop().run_in_executor(None, encode)
    except InvalidParameterError as exc:           # a template that needs what the messages lack, and the like
        raise bad_request(exc.param, str(exc)) from None
    limits = (await s.health()).get("limits") or {}
    out: dict[str, Any] = {"count": len(ids), "max_model_len": limits.get("max_model_len"), "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    """{"prompt": text} of the ids, special tokens included (as vLLM's)."""
    s = await _ready(request, body.model)
    vocab = len(s.tokenizer)
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab:
            raise bad_request(f"tokens[{i}]", f"token id {t} is outside the vocabulary [0, {vocab})")
    text = await asyncio.get_running_loop().run_in_executor(None, s.tokenizer.decode, body.tokens)
    return {"prompt": text}
