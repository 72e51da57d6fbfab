"""Public entry points."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .async_client import AsyncClient
    from .local_pipeline import Pipeline


def pipeline(model: str | None = None, **kwargs: Any) -> Pipeline:
    """Loads `model` (None: the default SmolLM2-135M-Instruct) in this process and returns a Pipeline.

    `model` is an HF directory, a repo id in the local HF cache, or a .gguf file. Keyword arguments are
    engine options (dtype, device, max_model_len, cache_dir, block_size, num_blocks, kv_cache_memory,
    enable_prefix_caching, max_batch_tokens, max_num_seqs); an unknown one raises InvalidParameterError.
    """
    from .config import EngineConfig
    from .local_pipeline import Pipeline

    return Pipeline(EngineConfig.from_kwargs(model, **kwargs))


def serve(model: str | None = None, *, replicas: int = 1, tensor_parallel: int | str = "auto", host: str = "127.0.0.1",
          port: int = 0, enable_http: bool = False, http_host: str = "127.0.0.1", http_port: int = 8000,
          **kwargs: Any) -> AsyncClient:
    """Starts a deployment — a router process and `replicas` × `tensor_parallel` worker processes — and
    returns an AsyncClient connected to it. Blocks until every replica is ready (or raises why it could not
    start: ModelNotFoundError, InvalidParameterError, …).

    `tensor_parallel="auto"` is 1 on CPU and, on GPUs, the smallest degree whose weight shard leaves room for a
    KV pool (the router logs its choice). `port=0` takes a free port (`client.address` says which).
    `enable_http=True` also starts the gateway (WebSocket, REST, OpenAI-compatible API, chat page, /health,
    /metrics) on `http_host:http_port` (0: a free port; `client.http_url` says which), with the gateway options
    api_key (default: $MII_ASYNC_API_KEY), served_model_name, allowed_hosts, allowed_origins, ws_max_message_bytes,
    ws_send_queue, ws_send_queue_bytes, ws_max_requests, ws_ping_s, max_body_bytes.
    Other keywords are deployment options (worker_host, worker_port, max_queued_requests, max_queued_tokens,
    heartbeat_s, heartbeat_timeout_s, client_timeout_s, drain_timeout_s, startup_timeout_s, restart_replicas,
    curve_dir) or engine options as for `pipeline()`. The processes stop on `await client.terminate_server()`,
    or when this process exits.
    """
    from .async_client import AsyncClient
    from .config import split_http_kwargs, split_serve_kwargs
    from .deployment import GatewayProcess, RouterProcess
    http, kwargs = split_http_kwargs(dict(http_host=http_host, http_port=http_port, **kwargs))
    if not isinstance(enable_http, bool):
        from .errors import InvalidParameterError

        raise InvalidParameterError("enable_http", f"must be true or false, got {enable_http!r}")
    serve_cfg, engine_cfg = split_serve_kwargs(model, dict(replicas=replicas, tensor_parallel=tensor_parallel,
                                                           host=host, port=port, **kwargs))
    proc = RouterProcess(serve_cfg, engine_cfg)
    gateway = None
    if enable_http:
        try:
            gateway = GatewayProcess(proc.address, http, serve_cfg.curve_dir, serve_cfg.drain_timeout_s)
        except BaseException:
            proc.stop(10.0)
            raise
    return AsyncClient(proc.address, curve_dir=serve_cfg.curve_dir, _process=proc, _gateway=gateway)


def client(address: str, *, curve_dir: str | None = None, timeout_s: float = 30.0) -> AsyncClient:
    """Connects to a running deployment's router, e.g. `client("tcp://127.0.0.1:5555")`. Connecting is lazy:
    an unreachable router shows as UnavailableError on the first request, after `timeout_s`."""
    from .async_client import AsyncClient

    return AsyncClient(address, curve_dir=curve_dir, timeout_s=timeout_s)
