"""RenderOptions: how a prompt becomes ids beyond its content — the chat template's extra variables, whether a
chat ends with the assistant's turn opened or inside its last message, the tokenizer's special tokens, and
truncation to the prompt's last tokens (vLLM's request fields of the same names and meanings).

Checked where they are built, each error naming the field: the gateway builds them from a request, the router
again from a Generate's fields (a client may send anything), the local pipeline from its caller's keyword.
PromptEncoder.encode applies them. Imports no torch.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidParameterError
from .unicode_text import check_text

MAX_TEMPLATE_KWARGS_CHARS = 65536   # chat_template_kwargs as compact JSON, at most
MAX_TRUNCATE = 2**31 - 1
# apply_chat_template's own parameters, and the template variables it sets itself: a caller's variable of one
# of these names would replace how we render (tokenize, tools, …) instead of adding to the template
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})
CHAT_ONLY = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")


@dataclass(frozen=True, kw_only=True)
class RenderOptions:
    chat_template_kwargs: dict[str, Any] | None = None   # a chat: extra variables for its template (a model's
                                       # enable_thinking; the gateway puts reasoning_effort and verbosity here);
                                       # JSON values, none of RESERVED_TEMPLATE_KWARGS
    add_generation_prompt: bool = True     # a chat: the prompt ends with the assistant's turn opened
    continue_final_message: bool = False   # a chat: the prompt ends inside its last message (the template's
                                           # end of that turn left out), which the answer continues; needs
                                           # add_generation_prompt false
    add_special_tokens: bool | None = None  # the tokenizer's special tokens (BOS) around the text; None: true
                                           # for a text, false for a chat (its template writes them); token ids
                                           # are used as given
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last this many tokens (after rendering
                                           # and tokenizing); None: all

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, "must be true or false")
        if self.add_special_tokens is not None and not isinstance(self.add_special_tokens, bool):
            raise InvalidParameterError("add_special_tokens", "must be true, false or null")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidParameterError("continue_final_message", "cannot be combined with add_generation_prompt: "
                                        "true (the prompt either opens a new turn or continues the last message); "
                                        "set add_generation_prompt to false")
        v = self.truncate_prompt_tokens
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_TRUNCATE):
            raise InvalidParameterError("truncate_prompt_tokens", f"must be an integer in [1, {MAX_TRUNCATE}] (how "
                                        f"many of the prompt's last tokens to keep), got {v!r}")
        if self.chat_template_kwargs is not None:
            object.__setattr__(self, "chat_template_kwargs", _template_kwargs(self.chat_template_kwargs))

    @classmethod
    def coerce(cls, v: RenderOptions | dict[str, Any] | None, param: str = "render") -> RenderOptions:
        """A caller's options: a RenderOptions, a dict of its fields, or None (the defaults)."""
        if v is None:
            return cls()
        if isinstance(v, RenderOptions):
            return v
        if not isinstance(v, dict):
            raise InvalidParameterError(param, "must be a RenderOptions or a dict of its fields, got "
                                        f"{type(v).__name__}")
        if unknown := sorted(set(v) - _NAMES):
            raise InvalidParameterError(f"{param}.{unknown[0]}", f"unknown render option; known ones: "
                                        f"{', '.join(sorted(_NAMES))}")
        return cls(**v)

    @classmethod
    def of(cls, fields: Any) -> RenderOptions:
        """From an object with these fields as attributes (a Generate message), checked."""
        return cls(**{name: getattr(fields, name) for name in _NAMES})

    @property
    def is_default(self) -> bool:
        return self == _DEFAULT

    def chat_only_given(self) -> str | None:
        """The first option set away from its default that only a chat can use, or None."""
        return next((n for n in CHAT_ONLY if getattr(self, n) != getattr(_DEFAULT, n)), None)

    def to_wire(self) -> dict[str, Any]:
        """The Generate message's fields of the same names."""
        return {name: getattr(self, name) for name in _NAMES}

    def template_extra(self) -> dict[str, Any]:
        """What apply_chat_template gets besides the messages, tools and add_generation_prompt."""
        extra = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            extra["continue_final_message"] = True
        return extra


_NAMES = frozenset(f.name for f in dataclasses.fields(RenderOptions))
_DEFAULT = RenderOptions()


def _template_kwargs(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise InvalidParameterError("chat_template_kwargs", "must be an object of template variables")
    if reserved := sorted(set(v) & RESERVED_TEMPLATE_KWARGS):
        raise InvalidParameterError(f"chat_template_kwargs.{reserved[0]}", f"{reserved[0]!r} is how the prompt is "
                                    "rendered, not a template variable: give it as a request field where there is "
                                    "one (add_generation_prompt, continue_final_message, tools)")
    try:
        text = json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidParameterError("chat_template_kwargs", f"must be JSON: {exc}") from None
    if len(text) > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidParameterError("chat_template_kwargs", f"at most {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON")
    check_text("chat_template_kwargs", v)
    return json.loads(text)              # a copy of plain JSON values (no tuples, no subclasses)
