"""Public entry points."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .async_client import AsyncClient
    from .local_pipeline import Pipeline
    from .query_handle import QueryHandle


def pipeline(model: str | None = None, **kwargs: Any) -> Pipeline:
    """Loads `model` (None: the default SmolLM2-135M-Instruct) in this process and returns a Pipeline.

    `model` is an HF directory, a repo id in the local HF cache, or a .gguf file. Keyword arguments are
    engine options (dtype, device, max_model_len, cache_dir, quantization ("fp8": docs/quantization.md),
    block_size, num_blocks, kv_cache_memory, enable_prefix_caching, max_batch_tokens, max_num_seqs); an unknown
    one raises InvalidParameterError.
    DeepSpeed-MII 0.3's `model_name_or_path`, `max_length` (max_model_len) and `tensor_parallel=1` are read
    as such; a pipeline is one process, so a larger tensor_parallel is refused, naming serve() and
    mii_query_handle(), which run one.
    """
    from .config import EngineConfig
    from .errors import InvalidParameterError
    from .local_pipeline import Pipeline

    tp = kwargs.pop("tensor_parallel", 1)
    if tp != 1 or isinstance(tp, bool):
        raise InvalidParameterError("tensor_parallel", f"pipeline() runs the model in this process (1); for {tp!r} "
                                    "worker processes use serve(model, tensor_parallel=T) or "
                                    "mii_query_handle(model, tensor_parallel=T)")
    for alias, ours in (("model_name_or_path", "model"), ("max_length", "max_model_len")):
        if alias in kwargs:
            value = kwargs.pop(alias)
            if (model if ours == "model" else kwargs.get(ours)) not in (None, value):
                raise InvalidParameterError(alias, f"and {ours} name the same option: give one of them")
            if ours == "model":
                model = value
            else:
                kwargs[ours] = value
    return Pipeline(EngineConfig.from_kwargs(model, **kwargs))


def serve(model: str | None = None, *, replicas: int = 1, tensor_parallel: int | str = "auto", host: str = "127.0.0.1",
          port: int = 0, enable_http: bool = False, http_host: str = "127.0.0.1", http_port: int | None = None,
          deployment_name: str | None = None, **kwargs: Any) -> AsyncClient:
    """Starts a deployment — a router process and `replicas` × `tensor_parallel` worker processes — and
    returns an AsyncClient connected to it. Blocks until every replica is ready (or raises why it could not
    start: ModelNotFoundError, InvalidParameterError, …).

    `tensor_parallel="auto"` is 1 on CPU and, on GPUs, the smallest degree whose weight shard leaves room for a
    KV pool (the router logs its choice). `port=0` takes a free port (`client.address` says which).
    `enable_http=True` also starts the gateway (WebSocket, REST, OpenAI-compatible API, chat page, /health,
    /metrics) on `http_host:http_port` (default 8000; 0: a free port; `client.http_url` says which), with the
    gateway options api_key (default: $MII_ASYNC_API_KEY), served_model_name, allowed_hosts, allowed_origins,
    ws_max_message_bytes, ws_send_queue, ws_send_queue_bytes, ws_max_requests, ws_ping_s, max_body_bytes,
    header_timeout_s, max_header_bytes, max_connections, max_connections_per_ip, max_websockets,
    max_websockets_per_ip, ws_idle_timeout_s, lenient_requests (docs/gateway.md "Limits"), and the Batch API's
    jobs_dir (its store), jobs_max_file_bytes, jobs_max_lines, jobs_max_stored_bytes and jobs_retention_s (its
    limits; docs/jobs.md), which the returned client's `jobs` also keeps;
    `enable_terminate=True` lets the gateway answer `GET /terminate` (off by default; the API key applies).
    `deployment_name` names the deployment on this host: `mii_async.client(name)` finds it from any process of
    this user, and the gateway answers `POST /mii/{name}`.
    Other keywords are deployment options (worker_host, worker_port, max_queued_requests, max_queued_tokens,
    max_background_per_replica, heartbeat_s, heartbeat_timeout_s, client_timeout_s, drain_timeout_s, startup_timeout_s, restart_replicas,
    curve_dir) or engine options as for `pipeline()`; the seed document's and DeepSpeed-MII 0.3's keywords
    (model_name, enable_rest, replica_num, enable_restful_api, restful_api_port, max_length, …) are read as
    docs/mii_compat.md says. An unknown keyword raises InvalidParameterError listing every option. The
    processes stop on `client.terminate_server()` (from plain code or awaited), or when this process exits.
    """
    from .async_client import AsyncClient
    from .config import split_http_kwargs, split_serve_kwargs
    from .deployment import GatewayProcess, RouterProcess
    from .deployment_registry import check_name, check_name_free
    from .served_deployment import ServedDeployment
    from .serve_options import resolve

    named = dict(replicas=replicas, tensor_parallel=tensor_parallel, host=host, port=port, enable_http=enable_http,
                 http_host=http_host, http_port=http_port, deployment_name=deployment_name)
    defaults = dict(replicas=1, tensor_parallel="auto", host="127.0.0.1", port=0, enable_http=False,
                    http_host="127.0.0.1", http_port=None, deployment_name=None)
    given = {k: v for k, v in named.items() if type(v) is not type(defaults[k]) or v != defaults[k]}
    opts = resolve({"model": model, **given, **kwargs})
    if opts.deployment_name is not None:
        check_name_free(check_name(opts.deployment_name))
    http, kwargs = split_http_kwargs(opts.kwargs)
    serve_cfg, engine_cfg = split_serve_kwargs(opts.model, kwargs)
    proc = RouterProcess(serve_cfg, engine_cfg)
    gateway = None
    try:
        if opts.enable_http:
            gateway = GatewayProcess(proc.address, http, proc.curve_dir, serve_cfg.drain_timeout_s)
        served = ServedDeployment(proc, gateway, name=opts.deployment_name, model=opts.model,
                                  terminate_route=opts.enable_terminate)
    except BaseException:
        if gateway is not None:
            gateway.stop(10.0)
        proc.stop(10.0)
        raise
    return AsyncClient(proc.address, curve_dir=proc.curve_dir, _process=served, _gateway=served.gateway)


def client(address: str, *, curve_dir: str | None = None, timeout_s: float = 30.0) -> AsyncClient:
    """Connects to a running deployment: `address` is its router's address (`tcp://127.0.0.1:5555`, or
    `127.0.0.1:5555`), or the `deployment_name` it was served under on this host (DeepSpeed-MII's
    `mii.client("mydeployment")`, found in deployment_registry.py). Connecting is lazy: an unreachable router
    shows as UnavailableError on the first request, after `timeout_s`. Anything else raises
    InvalidParameterError naming `address` and what it takes."""
    from .async_client import AsyncClient

    target, found_keys = _router_address(address)
    return AsyncClient(target, curve_dir=curve_dir or found_keys, timeout_s=timeout_s)


def mii_query_handle(model: str | None = None, tensor_parallel: int = 1, **options: Any) -> QueryHandle:
    """The seed document's handle: `mii_query_handle(model, tensor_parallel=T).query(prompts=[…], **params)`.
    T = 1 runs the model in this process (a pipeline); T > 1 starts a local deployment of T worker processes,
    stopped by `handle.close()` (or when this process exits). `options`: engine options, and for T > 1
    serve()'s. See query_handle.py."""
    from .query_handle import QueryHandle

    return QueryHandle(model, tensor_parallel, options)


_ACCEPTS = ("a router address such as 'tcp://127.0.0.1:5555' (or '127.0.0.1:5555'), or the deployment_name "
            "of a deployment served on this host")


def _router_address(address: Any) -> tuple[str, str | None]:
    """`client()`'s argument → (the router's address, the keys directory its registry entry names, if any)."""
    from . import deployment_registry as registry
    from .errors import InvalidParameterError

    if not isinstance(address, str) or not address.strip():
        raise InvalidParameterError("address", f"must be {_ACCEPTS}; got {address!r}")
    text = address.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme == "ipc" and rest:
            return text, None
        if scheme != "tcp":
            raise InvalidParameterError("address", f"{text!r}: the scheme must be tcp:// (or ipc://); {_ACCEPTS}")
        return "tcp://" + _host_port(rest, text), None
    if registry.NAME.fullmatch(text):                # no ':' in a name
        entry = registry.find(text)
        if entry is None:
            live = [e.name for e in registry.live_entries() if e.name]
            raise InvalidParameterError("address", f"no deployment named {text!r} runs on this host (named ones "
                                        f"running: {', '.join(live) or 'none'}); client() takes {_ACCEPTS}")
        return entry.address, entry.curve_dir
    return "tcp://" + _host_port(text, text), None


def _host_port(rest: str, text: str) -> str:
    from .errors import InvalidParameterError

    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in rest:
        raise InvalidParameterError("address", f"{text!r} is not HOST:PORT with a port in 1..65535; client() takes "
                                    f"{_ACCEPTS}")
    return f"{host}:{int(port)}"
