"""The gateway's command-line options (`mii-async serve` and `mii-async gateway`) and the HttpConfig fields they
give: address and port, API key, model name, origins and hosts, leniency, connection limits, the jobs store."""
from __future__ import annotations

import argparse
from typing import Any

_LIMIT_FLAGS = (("header_timeout_s", "--header-timeout", float, "seconds a request's headers may take to arrive "
                  "(from connect, or from a kept-alive request's first byte); then 408"),
                ("max_header_bytes", "--max-header-bytes", int, "a larger request line + headers: 431"),
                ("max_connections", "--max-connections", int, "open HTTP connections; a new one beyond: 503"),
                ("max_connections_per_ip", "--max-connections-per-ip", int,
                 "open HTTP connections per client address (a reverse proxy's clients share its address)"),
                ("max_websockets", "--max-websockets", int, "open WebSockets; a new one beyond is closed (1013)"),
                ("max_websockets_per_ip", "--max-websockets-per-ip", int, "open WebSockets per client address"),
                ("ws_idle_timeout_s", "--ws-idle-timeout", float,
                 "seconds a WebSocket may go without a client message or live request; then closed (1001)"))


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-host", default="127.0.0.1", help="the gateway's address (default: loopback only)")
    p.add_argument("--http-port", type=int, default=8000, help="the gateway's port (0: any free one)")
    p.add_argument("--api-key", default=None, help="required on every HTTP and WebSocket route "
                   "(default: $MII_ASYNC_API_KEY; none: open)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the OpenAI API")
    p.add_argument("--allowed-origin", action="append", default=None, metavar="ORIGIN",
                   help="a web origin (https://app.example.com) whose pages may open the WebSocket, besides those of "
                   "allowed hosts; repeatable; '*' for any")
    p.add_argument("--allowed-hosts", action="append", default=None, metavar="NAMES",
                   help="host names (comma-separated; repeatable) that requests may name in Host, besides loopback "
                   "and the --http-host address: others are refused, against DNS rebinding; '*.example.com' for "
                   "subdomains, '*' for any")
    p.add_argument("--lenient-requests", action="store_true",
                   help="OpenAI routes: drop unknown request fields (a warning logged once per name) instead of "
                   "refusing them with a 400, as vLLM does")
    p.add_argument("--jobs-dir", default=None, help="the Files and Batches API's store, one gateway's own "
                   "(default: $MII_ASYNC_CACHE/jobs, else ~/.cache/mii_async/jobs; docs/jobs.md)")
    from .jobs.batch_cli import add_limit_args

    add_limit_args(p)                               # --jobs-max-file-bytes, --jobs-max-lines, …
    _add_limit_args(p)


def http_fields(a: argparse.Namespace) -> dict[str, Any]:
    """The HttpConfig fields the options give, all but the API key (which never goes into a config that is
    passed on a command line)."""
    from .jobs.batch_cli import limit_fields

    return {"http_host": a.http_host, "http_port": a.http_port, "served_model_name": a.served_model_name,
            "allowed_origins": a.allowed_origin or [], "allowed_hosts": _hosts(a),
            **{field: v for field, *_ in _LIMIT_FLAGS if (v := getattr(a, field)) is not None},
            "lenient_requests": a.lenient_requests, **({"jobs_dir": a.jobs_dir} if a.jobs_dir else {}),
            **limit_fields(a)}


def gateway_config(a: argparse.Namespace) -> str:
    """`mii-async gateway`'s config as JSON, checked; a given --api-key goes to the gateway's environment."""
    import json
    import os

    from .config import HttpConfig
    from .gateway.main import API_KEY_ENV

    if a.api_key:
        os.environ[API_KEY_ENV] = a.api_key         # read by the gateway, kept off its config
    cfg = http_fields(a)
    HttpConfig(**cfg)
    return json.dumps(cfg)


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """The gateway's connection limits (HttpConfig fields, docs/gateway.md "Limits"); unset: its defaults."""
    from .config import HttpConfig

    for field, flag, kind, text in _LIMIT_FLAGS:
        p.add_argument(flag, type=kind, default=None, dest=field,
                       help=f"{text} (default: {getattr(HttpConfig, field):g})")


def _hosts(a: argparse.Namespace) -> list[str]:
    return [h.strip() for arg in a.allowed_hosts or () for h in arg.split(",") if h.strip()]
