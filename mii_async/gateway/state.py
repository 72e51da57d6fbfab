"""GatewayState: what every route of one gateway shares — its router client, config, tokenizer and metrics."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from ..async_client import AsyncClient
from ..config import HttpConfig
from ..errors import MIIAsyncError
from ..text.prompts import check_prompt_size
from .metrics import Metrics

log = logging.getLogger("mii_async.gateway")
CHAT_MAX_TOKENS_CAP = 4096  # a chat request without max_tokens gets the room its prompt leaves (the router
                            # fits it: fit_context), up to this: the router counts prompt + max_tokens against
                            # max_queued_tokens, so the whole context by default would let a handful of chats
                            # fill the admission budget
HEALTH_CACHE_S = 0.5        # /health and /metrics ask the router at most this often


class GatewayState:
    def __init__(self, client: AsyncClient, config: HttpConfig, tokenizer_path: str | None = None) -> None:
        self.client = client
        self.config = config
        self.metrics = Metrics()
        self.tokenizer_path = tokenizer_path
        self.tokenizer: Any = None            # the model's, loaded by load_tokenizer at the first route that needs it
        self._tokenizer_tried = False
        self._tokenizer_lock = asyncio.Lock()
        self.model_name = config.served_model_name or ""
        self.created = int(time.time())
        self._health: tuple[float, dict] | None = None
        self._health_lock = asyncio.Lock()
        self._init_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Asks the router what it serves (the model's name). A router that does not answer yet is asked again
        every 2 s. No tokenizer is loaded here: the router renders and tokenizes prompts and sends the texts of
        logprobs' tokens; only /tokenize, /detokenize and the echo of a token-id prompt need one
        (`load_tokenizer`)."""
        h = await self.health(fresh=True)
        if "error" in h:
            log.warning("the router does not answer yet; the gateway answers 503 until it does")
            self._init_task = asyncio.ensure_future(self._init_later())
            return
        self._init_from(h)

    async def _init_later(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            h = await self.health(fresh=True)
            if "error" not in h:
                self._init_from(h)
                return

    def _init_from(self, health: dict) -> None:
        if not self.model_name:
            model_path = self.tokenizer_path or health.get("model") or ""
            self.model_name = health.get("model_name") or os.path.basename(model_path.rstrip("/")) or "default"

    async def load_tokenizer(self) -> Any:
        """The model's tokenizer (from --tokenizer, else the router's model directory), loaded off the event loop
        once, at the first call; None where that directory is not on this host."""
        async with self._tokenizer_lock:
            if not self._tokenizer_tried:
                h = {} if self.tokenizer_path else await self.health()
                if "error" in h:
                    return None             # the router does not answer yet: ask again at the next call
                model_path = self.tokenizer_path or h.get("model") or ""
                if model_path and os.path.isdir(model_path):
                    from transformers import AutoTokenizer

                    self.tokenizer = await asyncio.get_running_loop().run_in_executor(
                        None, lambda: AutoTokenizer.from_pretrained(model_path))
                else:
                    log.warning("no tokenizer at %r: /tokenize and /detokenize answer 503, and the echo of a "
                                "token-id prompt shows no text", model_path)
                self._tokenizer_tried = True
            return self.tokenizer

    async def health(self, fresh: bool = False) -> dict:
        """The router's health, cached for HEALTH_CACHE_S; {"state": "unavailable", …} when it does not answer."""
        async with self._health_lock:
            now = time.monotonic()
            if not fresh and self._health is not None and now - self._health[0] < HEALTH_CACHE_S:
                return self._health[1]
            try:
                h = await asyncio.wait_for(self.client.health(), 5.0)
            except Exception as exc:  # noqa: BLE001 - any failure to answer means unavailable
                # The client's UnavailableError names the router and why (its connection closed, silence).
                why = str(exc) if isinstance(exc, MIIAsyncError) else \
                    f"the router does not answer: {str(exc) or type(exc).__name__}"
                h = {"state": "unavailable", "error": why, "replicas": []}
            self._health = (time.monotonic(), h)
            if "error" not in h and not self.config.served_model_name and h.get("model_name"):
                self.model_name = h["model_name"]       # follows the router (a restarted deployment)
            return h

    async def _context(self) -> int | None:
        """The most tokens one request may hold (prompt and answer), when the router said."""
        limits = (await self.health()).get("limits")
        return min(limits["max_model_len"], limits["max_request_tokens"]) if limits else None

    async def check_size(self, messages: list[dict[str, Any]], extra: Any = None) -> None:
        """Refuses, before the request is sent, a chat that cannot fit the context (the router's own check on
        arrival: text/prompts.check_prompt_size). `extra`: the tools the prompt shows."""
        context = await self._context()
        if context is not None:
            check_prompt_size(messages, extra, context)

    def close(self) -> None:
        if self._init_task is not None:
            self._init_task.cancel()
        self.client.close()
