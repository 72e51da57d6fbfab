"""Chat messages → the prompt's text through the model's own chat template, with the checks every caller's
messages pass first. Errors name `messages` (a template that refuses them) or `messages[i]` (a malformed one).
Imports no torch; the template and the tokenizer are the caller's (Hugging Face's `apply_chat_template`).
"""
from __future__ import annotations

from typing import Any

from ..errors import InvalidParameterError
from .unicode_text import check_text

MAX_MESSAGES = 4096


def check_messages(tokenizer: Any, messages: list[dict[str, Any]]) -> None:
    """Each message has a string role and a string content and is Unicode text; the tokenizer has a template."""
    if len(messages) > MAX_MESSAGES:
        raise InvalidParameterError("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidParameterError(f"messages[{i}]", "needs a string 'role' and a string 'content'")
        check_text(f"messages[{i}]", m)
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidParameterError("messages", "this model's tokenizer has no chat template")


def render_template(tokenizer: Any, messages: list[dict[str, Any]], tools: list | None,
                    add_generation_prompt: bool) -> str:
    """The chat template's text. Roles are the template's to accept: one it refuses (its own
    `raise_exception`, as Mistral's does for a role it lacks), or messages it cannot render, are the caller's
    error, named `messages`."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as exc:  # noqa: BLE001 - jinja2's TemplateError, or a template that needs what we lack
        raise InvalidParameterError("messages", f"the chat template cannot render these messages: {exc}") from None


class WithTemplateArgs:
    """A tokenizer whose `apply_chat_template` also gets a request's `extra` arguments (its template variables,
    continue_final_message): every render of that request sees them, chat_tools.py's probes and fallback
    included, through the same calls as without. Anything else is the tokenizer's own."""

    def __init__(self, tokenizer: Any, extra: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        self._extra = extra

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(conversation, **kwargs, **self._extra)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)
