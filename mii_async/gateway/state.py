"""GatewayState: what every route of one gateway shares — its router client, config, tokenizer and metrics."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from ..async_client import AsyncClient
from ..config import HttpConfig
from ..errors import RequestTooLongError
from .metrics import Metrics

log = logging.getLogger("mii_async.gateway")
DEFAULT_MAX_TOKENS = 128  # for a chat request without max_tokens when the limits are not known
CHAT_MAX_TOKENS_CAP = 4096  # a chat request without max_tokens gets the room left, up to this: the router
                            # counts prompt + max_tokens against max_queued_tokens, so the whole context
                            # by default would let a handful of chats fill the admission budget
HEALTH_CACHE_S = 0.5        # /health and /metrics ask the router at most this often
MAX_CACHED_TEXTS = 1 << 20  # token texts cached (vocabularies are ~32k–260k tokens)


class GatewayState:
    def __init__(self, client: AsyncClient, config: HttpConfig, tokenizer_path: str | None = None) -> None:
        self.client = client
        self.config = config
        self.metrics = Metrics()
        self.tokenizer_path = tokenizer_path
        self.tokenizer: Any = None            # loaded at startup from the router's model directory
        self._texts: dict[int, str] = {}      # token id → tokenizer.decode([id]): bounded by the vocabulary
        self._bytes: dict[int, bytes] = {}    # token id → its bytes (chat logprobs), as bounded
        self._speller: Any = None
        self.model_name = config.served_model_name or ""
        self.created = int(time.time())
        self._health: tuple[float, dict] | None = None
        self._health_lock = asyncio.Lock()
        self._init_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Asks the router what it serves, and loads that model's tokenizer (token strings for logprobs,
        echo, the room a chat prompt leaves). A router that does not answer yet is asked again every 2 s."""
        h = await self.health(fresh=True)
        if "error" in h:
            log.warning("the router does not answer yet; the gateway answers 503 until it does")
            self._init_task = asyncio.ensure_future(self._init_later())
            return
        await self._init_from(h)

    async def _init_later(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            h = await self.health(fresh=True)
            if "error" not in h:
                await self._init_from(h)
                return

    async def _init_from(self, health: dict) -> None:
        model_path = self.tokenizer_path or health.get("model") or ""
        if not self.model_name:
            self.model_name = health.get("model_name") or os.path.basename(model_path.rstrip("/")) or "default"
        if model_path and os.path.isdir(model_path):
            from transformers import AutoTokenizer

            self.tokenizer = await asyncio.get_running_loop().run_in_executor(
                None, lambda: AutoTokenizer.from_pretrained(model_path))
        else:
            log.warning("no tokenizer at %r: logprobs carry token ids as their text", model_path)

    async def health(self, fresh: bool = False) -> dict:
        """The router's health, cached for HEALTH_CACHE_S; {"state": "unavailable", …} when it does not answer."""
        async with self._health_lock:
            now = time.monotonic()
            if not fresh and self._health is not None and now - self._health[0] < HEALTH_CACHE_S:
                return self._health[1]
            try:
                h = await asyncio.wait_for(self.client.health(), 5.0)
            except Exception as exc:  # noqa: BLE001 - any failure to answer means unavailable
                h = {"state": "unavailable", "error": f"the router does not answer: {str(exc) or type(exc).__name__}",
                     "replicas": []}
            self._health = (time.monotonic(), h)
            if "error" not in h and not self.config.served_model_name and h.get("model_name"):
                self.model_name = h["model_name"]       # follows the router (a restarted deployment)
            return h

    async def _context(self) -> int | None:
        """The most tokens one request may hold (prompt and answer), when the router said."""
        limits = (await self.health()).get("limits")
        return min(limits["max_model_len"], limits["max_request_tokens"]) if limits else None

    async def check_size(self, messages: list[dict[str, Any]], extra: Any = None) -> None:
        """Refuses, before any template or tokenizer runs, a chat that cannot fit the context: no tokenizer packs
        64 characters a token. `extra`: what else the prompt shows (tools), counted as its JSON."""
        context = await self._context()
        if context is None:
            return
        chars = sum(len(m["content"]) for m in messages) + (len(json.dumps(extra)) if extra else 0)
        if chars > 64 * context:
            raise RequestTooLongError("messages", f"the prompt cannot fit the context of {context} tokens")

    async def room_for(self, messages: list[dict[str, str]]) -> int:
        """max_tokens for a chat request that names none: what is left of the context (and of the KV pool)
        after the prompt, as OpenAI and vLLM do, up to CHAT_MAX_TOKENS_CAP. The chat template and the
        tokenizer run off the event loop."""
        if await self._context() is None or self.tokenizer is None:
            return DEFAULT_MAX_TOKENS
        await self.check_size(messages)
        from ..text.prompts import PromptEncoder

        _, ids = await asyncio.get_running_loop().run_in_executor(None, PromptEncoder(self.tokenizer).encode,
                                                                  messages)
        return await self.room_after(len(ids))

    async def room_after(self, prompt_tokens: int) -> int:
        """room_for a prompt of this many tokens (one the gateway rendered itself)."""
        context = await self._context()
        if context is None:
            return DEFAULT_MAX_TOKENS
        room = context - prompt_tokens
        if room < 1:
            raise RequestTooLongError("messages", f"the prompt ({prompt_tokens} tokens) leaves no room in the "
                                      f"context of {context} tokens")
        return min(room, CHAT_MAX_TOKENS_CAP)

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (decode([id])), cached: a prompt's logprobs name (1 + n) tokens
        per prompt token, and decoding each on the event loop took ~1.7 s for a 39k-token prompt at n = 20. A
        miss costs one decode (~2 µs): the whole vocabulary, once (0.1 s for 49k tokens), is a twentieth of that."""
        t = self._texts.get(token_id)
        if t is None:
            if self.tokenizer is None:
                return f"<{token_id}>"
            if len(self._texts) >= MAX_CACHED_TEXTS:     # ids outside the vocabulary: do not grow without end
                self._texts.clear()
            t = self._texts[token_id] = self.tokenizer.decode([token_id])
        return t

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes (chat logprobs' `bytes`): joined, they spell the output even where a token holds
        part of a character, which its text shows as U+FFFD. Cached as token_text is."""
        b = self._bytes.get(token_id)
        if b is None:
            if self._speller is None:
                from ..text.token_bytes import TokenSpeller

                self._speller = TokenSpeller.of(self.tokenizer) or False
            if not self._speller:      # no tokenizer, or a slow one without the `tokenizers` backend: its text
                return self.token_text(token_id).encode()
            if len(self._bytes) >= MAX_CACHED_TEXTS:
                self._bytes.clear()
            b = self._bytes[token_id] = self._speller.spell(token_id)
        return b

    def close(self) -> None:
        if self._init_task is not None:
            self._init_task.cancel()
        self.client.close()
