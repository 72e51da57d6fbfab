"""CheckedRoute: every JSON body the gateway's routes take is checked for strings that are not Unicode text
(a lone surrogate, "\\ud800", is legal JSON) before the route parses it, so that any field holding one is
a 400 naming it, not a 500 from the tokenizer, msgpack or the reply (mii_async/text/unicode_text.py)."""
from __future__ import annotations

from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute

from ..errors import InvalidParameterError
from ..text.unicode_text import check_json_text
from .http_errors import from_exception


class CheckedRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH"):
                try:
                    check_json_text(await request.body())      # read once: the route reads it from the cache
                except InvalidParameterError as exc:
                    raise from_exception(exc) from None
            return await handle(request)

        return checked
