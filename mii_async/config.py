"""Frozen configuration: model, KV cache, scheduler, deployment. Validated at construction, passed whole.

Keyword arguments from the public entry points (`pipeline(**kwargs)`) are routed to these by field name;
an unknown key is an error that names it.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidParameterError

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("fp8", "int4")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def default_cache_dir() -> str:
    """Where converted models live: $MII_ASYNC_CACHE, else ~/.cache/mii_async."""
    return os.environ.get("MII_ASYNC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mii_async")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None           # HF dir, HF repo id (local cache only), .gguf file; None: the default model
    dtype: str = "auto"                # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"               # auto: cuda when available, else cpu
    max_model_len: int | None = None   # cap on prompt + output tokens; None: the model's own
    cache_dir: str = field(default_factory=default_cache_dir)  # converted models
    kernels: str = "auto"              # auto: the CuPy/CUDA kernels on a GPU when cupy imports, the native CPU
                                       # kernels on the CPU when a C compiler builds them, else reference
    cuda_graphs: bool = True           # on a GPU, replay decode steps from CUDA graphs (False: always eager)
    piecewise_graphs: bool = True      # with cuda_graphs: steps with prompt chunks replay their layers' dense
                                       # parts from graphs, attention eager between them
    quantization: str | None = None    # "fp8": the linear weights in FP8 e4m3, quantized at load per output
                                       # channel (GPU); "int4": 4-bit weights in groups of 32, the head in int8,
                                       # activations in bf16 (CPU); docs/quantization.md. None: as the checkpoint
                                       # holds them (an FP8 checkpoint's quantization_config is followed)
    threads: int | None = None         # CPU: torch's intra-op threads; None: one per CPU this process may use

    def __post_init__(self) -> None:
        dt = _DTYPE_ALIASES.get(str(self.dtype), str(self.dtype))
        if dt not in DTYPES:
            raise InvalidParameterError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dt)
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise InvalidParameterError("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        _pos_int(self, "max_model_len", optional=True)
        if self.kernels not in ("auto", "reference", "cuda", "cpu"):
            raise InvalidParameterError("kernels", f"must be auto, reference, cuda or cpu, got {self.kernels!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise InvalidParameterError("cuda_graphs", f"must be true or false, got {self.cuda_graphs!r}")
        if not isinstance(self.piecewise_graphs, bool):
            raise InvalidParameterError("piecewise_graphs", f"must be true or false, got {self.piecewise_graphs!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidParameterError("quantization", f"must be one of {', '.join(QUANTIZATIONS)} or None, "
                                        f"got {self.quantization!r}")
        _pos_int(self, "threads", optional=True)


@dataclass(frozen=True)
class CacheConfig:
    CPU_KV_GIB = 0.5                   # the CPU pool when kv_cache_memory is None
    block_size: int = 16               # tokens per KV block
    num_blocks: int | None = None      # KV pool size in blocks; None: from kv_cache_memory
    kv_cache_memory: float | None = None  # GiB for the KV pool; None: 0.5 on CPU, the memory plan on a GPU
    gpu_memory_utilization: float = 0.9   # GPU: the share of the device's memory this replica may use in all
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"          # "auto": the model's dtype; "fp8": e4m3 (half of bf16's bytes)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype == "fp8_e4m3":               # vLLM's other name for it
            object.__setattr__(self, "kv_cache_dtype", "fp8")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise InvalidParameterError("kv_cache_dtype", f"must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        _pos_int(self, "block_size")
        if self.block_size & (self.block_size - 1):
            raise InvalidParameterError("block_size", f"must be a power of two, got {self.block_size}")
        _pos_int(self, "num_blocks", optional=True)
        v = self.kv_cache_memory
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise InvalidParameterError("kv_cache_memory", f"must be a positive number of GiB, got {v!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise InvalidParameterError("gpu_memory_utilization", f"must be in (0, 1], got {u!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int | None = None  # SplitFuse token budget per step (decodes + prompt chunks); None: 512 on
                                         # CPU, 2048 on a GPU
    max_num_seqs: int | None = None      # running sequences at most; None: 64 on CPU, 256 on a GPU (at most
                                         # max_batch_tokens: a step decodes every running sequence)
    async_scheduling: bool | None = None  # plan and launch step N+1 while step N runs, its sampled ids still on
                                          # the device; None: on a GPU, for a replica of one process
    max_mixed_batch_tokens: int | None = None  # the budget of a step that carries decodes, whose length is every
                                         # running stream's inter-token gap: prompt chunks beside decodes stop
                                         # here (decodes themselves are never held back by it); at most
                                         # max_batch_tokens; None: 1536 on a GPU, 256 on CPU
    step_token_multiple: int | None = None  # a step with prompt chunks is cut to a multiple of this many tokens
                                         # (the GEMMs' tile along tokens, the piecewise graphs' bucket) where its
                                         # newest chunk can give up the rest, which goes to the next step; None:
                                         # 64 on a GPU, not cut on CPU; 1: not cut

    DEFAULTS = {"cpu": (512, 64, 256, None), "cuda": (2048, 256, 1536, 64)}

    def __post_init__(self) -> None:
        _pos_int(self, "max_batch_tokens", optional=True)
        _pos_int(self, "max_num_seqs", optional=True)
        _pos_int(self, "max_mixed_batch_tokens", optional=True)
        _pos_int(self, "step_token_multiple", optional=True)
        if self.max_batch_tokens and self.max_num_seqs and self.max_batch_tokens < self.max_num_seqs:
            raise InvalidParameterError("max_batch_tokens", f"must be at least max_num_seqs ({self.max_num_seqs}): "
                                        f"a step decodes every running sequence; got {self.max_batch_tokens}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise InvalidParameterError("async_scheduling", f"must be true, false or null, got {self.async_scheduling!r}")

    def resolved(self, device_type: str) -> SchedulerConfig:
        """This config with the device's defaults in place of None."""
        tokens, seqs, mixed, multiple = self.DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
        tokens = self.max_batch_tokens or tokens
        seqs = self.max_num_seqs or min(seqs, tokens)    # no more running than one step can decode
        if seqs > tokens:                                # given, over this device's default budget
            raise InvalidParameterError("max_num_seqs", f"must be at most max_batch_tokens ({tokens} on {device_type}"
                                        f"): a step decodes every running sequence; got {seqs}")
        return SchedulerConfig(tokens, seqs, self.async_scheduling,
                               min(self.max_mixed_batch_tokens or mixed or tokens, tokens),
                               self.step_token_multiple or multiple)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineConfig:
        """Routes flat keyword arguments to the sub-configs; an unknown key is an error naming it."""
        parts: dict[type, dict[str, Any]] = {ModelConfig: {"model": model}, CacheConfig: {}, SchedulerConfig: {}}
        for key, value in kwargs.items():
            for sub, vals in parts.items():
                if key in _field_names(sub):
                    vals[key] = value
                    break
            else:
                known = sorted(set().union(*(_field_names(s) for s in parts)))
                raise InvalidParameterError(key, f"unknown option; known ones: {', '.join(known)}")
        return cls(ModelConfig(**parts[ModelConfig]), CacheConfig(**parts[CacheConfig]),
                   SchedulerConfig(**parts[SchedulerConfig]))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain data for the wire (the router's Assign message)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        return cls(ModelConfig(**d.get("model", {})), CacheConfig(**d.get("cache", {})),
                   SchedulerConfig(**d.get("scheduler", {})))


@dataclass(frozen=True)
class ServeConfig:
    """A deployment: how many replicas, where the router listens, its limits and its health timings."""
    replicas: int = 1                  # replicas the router starts itself (0: only workers that join)
    tensor_parallel: int | str = "auto"   # worker processes per replica; auto: 1 on CPU, the smallest that fits on GPU
    host: str = "127.0.0.1"            # the clients' socket (loopback unless told otherwise)
    port: int = 0                      # 0: any free port
    worker_host: str = "127.0.0.1"     # the workers' socket; a routable address lets other hosts join
    worker_port: int = 0
    max_queued_requests: int = 1024    # admitted, unfinished requests; past this: "overloaded"
    max_queued_tokens: int = 1 << 21   # their prompt + max_new_tokens, summed; past this: "overloaded"
    max_background_per_replica: int | None = None  # background requests (priority > 0, a batch's lines) in
                                       # flight on one replica at most; the rest wait in the router for spare
                                       # capacity; None: 2 on the CPU, a quarter of max_num_seqs on a GPU
    heartbeat_s: float = 1.0           # worker → router heartbeat period
    heartbeat_timeout_s: float = 15.0  # a replica silent this long is dead (process sentinels act at once)
    client_timeout_s: float = 30.0     # a client silent this long (no ping) with live requests: aborted
    drain_timeout_s: float = 30.0      # SIGTERM/SIGINT: let requests finish this long, then abort them
    startup_timeout_s: float = 900.0   # a replica not ready by then is stopped (first load converts the model)
    restart_replicas: bool = True      # replace a replica whose worker died
    curve_dir: str | None = None       # CURVE keys (`mii-async keys DIR`); None: no encryption, loopback use

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise InvalidParameterError("replicas", f"must be a non-negative integer, got {self.replicas!r}")
        if self.tensor_parallel != "auto":
            _pos_int(self, "tensor_parallel")
        for name in ("port", "worker_port"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 65536:
                raise InvalidParameterError(name, f"must be a TCP port (0 for any), got {v!r}")
        for name in ("host", "worker_host"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise InvalidParameterError(name, f"must be a host name or address, got {getattr(self, name)!r}")
        _pos_int(self, "max_queued_requests")
        _pos_int(self, "max_queued_tokens")
        _pos_int(self, "max_background_per_replica", optional=True)
        for name in ("heartbeat_s", "heartbeat_timeout_s", "client_timeout_s", "drain_timeout_s",
                     "startup_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (v == 0 and name != "drain_timeout_s"):
                raise InvalidParameterError(name, f"must be a positive number of seconds, got {v!r}")
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_s:
            raise InvalidParameterError("heartbeat_timeout_s", "must exceed twice heartbeat_s")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def split_serve_kwargs(model: str | None, kwargs: dict[str, Any]) -> tuple[ServeConfig, EngineConfig]:
    """Routes `serve(**kwargs)`: deployment fields to ServeConfig, the rest to EngineConfig (which rejects
    unknown keys, naming them)."""
    names = _field_names(ServeConfig)
    serve = ServeConfig(**{k: v for k, v in kwargs.items() if k in names})
    engine = EngineConfig.from_kwargs(model, **{k: v for k, v in kwargs.items() if k not in names})
    return serve, engine


def split_http_kwargs(kwargs: dict[str, Any]) -> tuple[HttpConfig, dict[str, Any]]:
    """Takes the gateway's fields (HttpConfig) out of `serve(**kwargs)`; returns them and the rest."""
    names = _field_names(HttpConfig)
    return HttpConfig(**{k: v for k, v in kwargs.items() if k in names}), {k: v for k, v in kwargs.items()
                                                                           if k not in names}


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?")


def host_name(value: Any) -> str | None:
    """A host name or address as the gateway compares them: lower case, IPv6 without brackets, addresses in
    their canonical form, no trailing dot; None for anything else (a port, a scheme, a path, spaces)."""
    if not isinstance(value, str) or not value:
        return None
    name = value.lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    name = name[:-1] if name.endswith(".") else name
    return name if _HOST_NAME.fullmatch(name) and ".." not in name else None


def _pos_int(obj: Any, name: str, optional: bool = False) -> None:
    v = getattr(obj, name)
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidParameterError(name, f"must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class HttpConfig:
    """The gateway: the HTTP/WebSocket front of a deployment (a client of its router like any other)."""
    http_host: str = "127.0.0.1"       # loopback unless told otherwise
    http_port: int = 8000              # 0: any free port
    api_key: str | None = None         # required on every route when set (or $MII_ASYNC_API_KEY)
    served_model_name: str | None = None  # the OpenAI `model` name; None: the model's directory name
    ws_max_message_bytes: int = 1 << 20   # a larger client frame closes the WebSocket (1009)
    ws_send_queue: int = 4096          # frames waiting for a slow reader; past this the socket is closed (1013)
    ws_send_queue_bytes: int = 64 << 20  # the same bound on their size (a frame with prompt_logprobs can be MBs)
    ws_max_requests: int = 256         # live requests per WebSocket connection
    ws_ping_s: float = 20.0            # WebSocket ping period; no pong within as long: closed
    max_body_bytes: int = 8 << 20      # a larger HTTP request body: 413
    allowed_origins: tuple[str, ...] = ()  # WebSocket Origins allowed besides those of allowed hosts ("*": any)
    # Host names (or addresses, or "*.example.com") a request's Host may name besides loopback and the address
    # the gateway is bound to: other names are refused (DNS rebinding). "*": any Host; Origins stay checked.
    allowed_hosts: tuple[str, ...] = ()
    # Slow and idle clients (gateway/connection_limits.py, gateway/ws_limits.py); each refusal closes the connection.
    header_timeout_s: float = 10.0     # a request's headers not all in by then (from connect, or first byte): 408
    max_header_bytes: int = 64 << 10   # a larger request line + headers: 431
    max_connections: int = 2048        # open HTTP connections (WebSockets not counted); a new one beyond: 503
    max_connections_per_ip: int = 512  # the same per client address (above the total: never acts)
    max_websockets: int = 1024         # open WebSockets; a new one beyond is closed with 1013 after its handshake
    max_websockets_per_ip: int = 256   # the same per client address
    ws_idle_timeout_s: float = 300.0   # a WebSocket without a client message or live request this long: 1001
    lenient_requests: bool = False     # OpenAI routes: an unknown request field is dropped, with a warning logged
                                       # once per name (vLLM's behaviour), instead of refused with a 400
    # The Files and Batches API's store: SQLite and the files' bytes (docs/jobs.md); one gateway per directory.
    jobs_dir: str = field(default_factory=lambda: os.path.join(default_cache_dir(), "jobs"))
    # Its bounds (jobs/limits.py JobLimits; None: the default there): an uploaded file's bytes, the request lines
    # of one batch, the bytes of all its files together, and how long a file or an ended batch is kept (seconds).
    jobs_max_file_bytes: int | None = None
    jobs_max_lines: int | None = None
    jobs_max_stored_bytes: int | None = None
    jobs_retention_s: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.http_host, str) or not self.http_host:
            raise InvalidParameterError("http_host", f"must be a host name or address, got {self.http_host!r}")
        v = self.http_port
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 65536:
            raise InvalidParameterError("http_port", f"must be a TCP port (0 for any), got {v!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InvalidParameterError("api_key", "must be a non-empty string or None")
        origins = (self.allowed_origins,) if isinstance(self.allowed_origins, str) else self.allowed_origins
        if not isinstance(origins, (list, tuple)) or not all(isinstance(o, str) and o for o in origins):
            raise InvalidParameterError("allowed_origins", "must be a list of origins such as "
                                        "'https://app.example.com', or ['*']")
        object.__setattr__(self, "allowed_origins", tuple(o.rstrip("/") for o in origins))
        hosts = (self.allowed_hosts,) if isinstance(self.allowed_hosts, str) else self.allowed_hosts
        if not isinstance(hosts, (list, tuple)):
            raise InvalidParameterError("allowed_hosts", f"must be a list of host names, got {hosts!r}")
        names = []
        for h in hosts:
            if h == "*":
                name = h
            elif isinstance(h, str) and h.startswith("*."):       # any subdomain of a name
                name = (suffix := host_name(h[2:])) and "*." + suffix
            else:
                name = host_name(h)
            if not name:
                raise InvalidParameterError("allowed_hosts", "each must be a host name or address without scheme "
                                            "or port ('chat.example.com', '10.0.0.5', '*.example.com'), or '*'; "
                                            f"got {h!r}")
            names.append(name)
        object.__setattr__(self, "allowed_hosts", tuple(names))
        for name in ("ws_max_message_bytes", "ws_send_queue", "ws_send_queue_bytes", "ws_max_requests",
                     "max_body_bytes", "max_header_bytes", "max_connections", "max_connections_per_ip",
                     "max_websockets", "max_websockets_per_ip"):
            _pos_int(self, name)
        if not isinstance(self.lenient_requests, bool):
            raise InvalidParameterError("lenient_requests", "must be true or false")
        if not isinstance(self.jobs_dir, str) or not self.jobs_dir:
            raise InvalidParameterError("jobs_dir", f"must be a directory path, got {self.jobs_dir!r}")
        for name in ("jobs_max_file_bytes", "jobs_max_lines", "jobs_max_stored_bytes", "jobs_retention_s"):
            _pos_int(self, name, optional=True)
        for name in ("ws_ping_s", "header_timeout_s", "ws_idle_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise InvalidParameterError(name, f"must be a positive number of seconds, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
