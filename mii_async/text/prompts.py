"""PromptEncoder: a prompt as a caller gives it (text, token ids or chat messages, with the tools a chat shows)
→ (text, token ids).

Used by the router (off its event loop) and by the local pipeline: the one place where a prompt becomes ids,
as a request's RenderOptions say (render_options.py: template variables, special tokens, truncation).
Errors name the parameter: `prompt` for a value of the wrong kind, `messages[i]` for a malformed chat message,
`tools[i]` for a malformed tool. `check_prompt_size` refuses, without tokenizing, a text or chat too long for any
tokenizer to fit a context: the router (on arrival) and the local pipeline call it before encoding.
Imports no torch.
"""
from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidParameterError, RequestTooLongError
from .chat_template import WithTemplateArgs, check_messages, render_template
from .chat_tools import has_tool_calls, render_chat
from .render_options import RenderOptions
from .unicode_text import check_text


# No tokenizer packs more characters than this into one token: a token stands for at most this many bytes (the
# longest of SmolLM2's vocabulary, a newline and 80 spaces, stands for 81), and a character is at least one byte.
# The margin covers vocabularies with longer runs and normalizers that compose a few characters into one.
MAX_CHARS_PER_TOKEN = 256


def is_token_ids(p: Any) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def check_token_ids(ids: Any, param: str = "prompt") -> None:
    """Token ids travel as uint32: one outside [0, 2**32) is the caller's error, named, not an overflow."""
    for t in ids:
        if not 0 <= t < 2**32:
            raise InvalidParameterError(param, f"token id {t} is out of range (ids are integers in [0, 2**32))")


def is_messages(p: Any) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, dict) for m in p)


def prompt_chars(prompt: Any, tools: Any = None) -> int | None:
    """The characters a prompt's text holds at least, counted without a tokenizer: a text's own; for a chat,
    its messages' string contents and its tools' compact JSON (our tool section and most templates show
    them whole). None for
    token ids and for a value of another kind (the encoder names what is wrong with it)."""
    if isinstance(prompt, str):
        return len(prompt)
    if not is_messages(prompt):
        return None
    n = sum(len(c) for m in prompt if isinstance(c := m.get("content"), str))
    if tools:
        try:
            n += len(json.dumps(tools, ensure_ascii=False, separators=(",", ":")))
        except (TypeError, ValueError):
            pass                                # not JSON: the encoder refuses these tools, naming them
    return n


def check_prompt_size(prompt: Any, tools: Any, context: int) -> None:
    """Refuses a text or chat that no tokenizer fits in `context` tokens (more than MAX_CHARS_PER_TOKEN
    characters a token) without tokenizing it: a tokenizer spends seconds on megabytes.
    Raises RequestTooLongError naming `prompt` (a text) or `messages` (a chat)."""
    n = prompt_chars(prompt, tools)
    if n is not None and n > MAX_CHARS_PER_TOKEN * context:
        param = "prompt" if isinstance(prompt, str) else "messages"
        raise RequestTooLongError(param, f"{n} characters cannot fit the context of {context} tokens (no "
                                  f"tokenizer packs more than {MAX_CHARS_PER_TOKEN} characters into a token)")


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, prompt: Any, tools: list[dict[str, Any]] | None = None, parallel_tool_calls: bool = True,
               options: RenderOptions | None = None) -> tuple[str | None, list[int]]:
        """Returns the prompt's text (None for token ids) and its token ids. `tools` (chat messages only): the
        functions the prompt shows; `parallel_tool_calls`: whether it allows several calls per answer;
        `options`: how it is rendered and tokenized (None: the defaults). A text cut by truncate_prompt_tokens
        is returned as its kept ids decode."""
        o = options if options is not None else RenderOptions()
        if tools is not None and not is_messages(prompt):
            raise InvalidParameterError("tools", "tools go with a chat: give the prompt as messages")
        if not is_messages(prompt) and (name := o.chat_only_given()) is not None:
            raise InvalidParameterError(name, f"{name} goes with a chat: give the prompt as messages")
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            text: str | None = prompt
            ids = list(self.tokenizer(prompt, add_special_tokens=o.add_special_tokens is not False)["input_ids"])
        elif is_token_ids(prompt):
            check_token_ids(prompt)
            text, ids = None, list(prompt)
        elif is_messages(prompt):
            text = self.render(list(prompt), tools, parallel_tool_calls, options=o)
            ids = list(self.tokenizer(text, add_special_tokens=bool(o.add_special_tokens))["input_ids"])
        else:
            raise InvalidParameterError("prompt", "must be a string, a list of token ids or a list of chat messages")
        k = o.truncate_prompt_tokens
        if k is not None and len(ids) > k:
            # as vLLM: the prompt's end is kept, where the question and the turn the answer continues are
            ids = ids[-k:]
            if text is not None:
                text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text, ids

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               parallel_tool_calls: bool = True, add_generation_prompt: bool = True, *,
               options: RenderOptions | None = None) -> str:
        """A chat's prompt text (the template holds its special tokens): with tools, or with a history that
        holds tool calls, as chat_tools.py renders them; else the messages through the template as they are.
        `options` (its add_generation_prompt in place of the argument): the template's extra variables and
        continue_final_message."""
        tokenizer = self.tokenizer
        if options is not None:
            add_generation_prompt = options.add_generation_prompt
            if extra := options.template_extra():
                tokenizer = WithTemplateArgs(tokenizer, extra)
        if tools or has_tool_calls(messages):
            return render_chat(tokenizer, messages, tools or None, parallel_tool_calls, add_generation_prompt)
        check_messages(tokenizer, messages)
        return render_template(tokenizer, messages, None, add_generation_prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        check_messages(self.tokenizer, messages)
        return render_template(self.tokenizer, messages, None, add_generation_prompt)
