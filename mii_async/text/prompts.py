"""PromptEncoder: a prompt as a caller gives it (text, token ids or chat messages) → (text, token ids).

Used by the router (off its event loop) and by the local pipeline. Errors name the parameter: `prompt` for a
value of the wrong kind, `messages[i]` for a malformed chat message. Imports no torch.
"""
from __future__ import annotations

from typing import Any

from ..errors import InvalidParameterError
from .unicode_text import check_text

MAX_MESSAGES = 4096


def is_token_ids(p: Any) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def check_token_ids(ids: Any, param: str = "prompt") -> None:
    """Token ids travel as uint32: one outside [0, 2**32) is the caller's error, named, not an overflow."""
    for t in ids:
        if not 0 <= t < 2**32:
            raise InvalidParameterError(param, f"token id {t} is out of range (ids are integers in [0, 2**32))")


def is_messages(p: Any) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, dict) for m in p)


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        """Returns the prompt's text (None for token ids) and its token ids."""
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if is_token_ids(prompt):
            check_token_ids(prompt)
            return None, list(prompt)
        if is_messages(prompt):
            text = self.apply_chat_template(list(prompt))
            return text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        raise InvalidParameterError("prompt", "must be a string, a list of token ids or a list of chat messages")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if len(messages) > MAX_MESSAGES:
            raise InvalidParameterError("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidParameterError(f"messages[{i}]", "needs a string 'role' and a string 'content'")
            check_text(f"messages[{i}]", m)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidParameterError("messages", "this model's tokenizer has no chat template")
        return render_template(self.tokenizer, messages, None, add_generation_prompt)


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
