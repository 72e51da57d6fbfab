"""serve()'s keywords: ours, the seed document's and DeepSpeed-MII 0.3's, resolved into ours.

    serve(model_name=M, tensor_parallel=2, port=50051, enable_rest=True)       # the seed's
    serve(M, deployment_name="d", replica_num=2, enable_restful_api=True,
          restful_api_port=28080, max_length=4096)                              # DeepSpeed-MII 0.3's

One port serves one protocol. `enable_rest=True` puts the REST gateway on `port` (what a seed user curls) and
the router on a free port (`client.address` says which; `mii_async.client(deployment_name)` finds it);
DeepSpeed-MII's `enable_restful_api=True` keeps the router on `port` (MII's `port_number`) and puts the gateway
on `restful_api_port` (MII's default: 28080). MII's `mii_config` / `model_config` dicts are read as keywords.
A keyword we cannot honour is refused naming the nearest one we have; an unknown one is refused listing
every option.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from .config import CacheConfig, HttpConfig, ModelConfig, SchedulerConfig, ServeConfig
from .errors import InvalidParameterError

MII_REST_PORT = 28080       # DeepSpeed-MII's restful_api_port default
# DeepSpeed-MII's and the seed's names for our options.
ALIASES = {"model_name": "model", "model_name_or_path": "model", "replica_num": "replicas", "port_number": "port",
           "max_length": "max_model_len", "restful_api_port": "http_port"}
# DeepSpeed-MII keywords we cannot honour → (why, the nearest supported option).
REFUSED: dict[str, tuple[str, str]] = {
    "deployment_type": ("deployments are local processes (DeepSpeed-MII's LOCAL)", "serve() as it is"),
    "hostfile": ("workers on other hosts join the router themselves",
                 "worker_host, and `mii-async worker --router tcp://HOST:PORT` on each host"),
    "quantization_mode": ("quantization is not implemented", "dtype"),
    "torch_dist_port": ("tensor-parallel ranks agree on a free rendezvous port themselves", "worker_port"),
    "zmq_port_number": ("the workers' ZeroMQ port is the router's", "worker_port"),
    "restful_processes": ("the gateway is one asyncio process", "ws_max_requests (live requests per WebSocket)"),
    "tokenizer": ("the tokenizer is the model directory's", "model"),
    "device_map": ("ranks take one device each", "device, tensor_parallel"),
    "inference_engine_config": ("the engine's options are keywords of their own",
                                "kv_cache_memory, max_batch_tokens, max_num_seqs, block_size"),
    "enable_deepspeed": ("the engine is mii_async's own", "serve() as it is"),
    "enable_zero": ("the engine is mii_async's own", "serve() as it is"),
    "all_rank_output": ("rank 0 answers for its replica", "serve() as it is"),
}
SERVE_OWN = ("model", "enable_http", "enable_rest", "enable_restful_api", "deployment_name", "enable_terminate",
             "task", "mii_config", "model_config")


class ServeOptions(NamedTuple):
    model: str | None
    deployment_name: str | None
    enable_http: bool
    enable_terminate: bool
    kwargs: dict[str, Any]      # ServeConfig, HttpConfig and engine fields by our names


def option_names() -> list[str]:
    """Every keyword serve() takes."""
    ours = set().union(*({f.name for f in dataclasses.fields(c)}
                         for c in (ServeConfig, HttpConfig, ModelConfig, CacheConfig, SchedulerConfig)))
    return sorted(ours | set(SERVE_OWN) | set(ALIASES))


def resolve(given: dict[str, Any]) -> ServeOptions:
    """`given`: serve()'s keywords as the caller wrote them (our defaults not filled in)."""
    kw = dict(given)
    for nested in ("mii_config", "model_config"):          # DeepSpeed-MII's dicts of keywords
        extra = kw.pop(nested, None)
        if extra is None:
            continue
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise InvalidParameterError(nested, f"must be a dict of serve() keywords, got {extra!r}")
        for k, v in extra.items():
            if k in kw and kw[k] != v:
                raise InvalidParameterError(k, f"given twice, as a keyword and in {nested}, with different values")
            kw[k] = v
    task = kw.pop("task", "text-generation")
    if task not in ("text-generation", "text_generation"):
        raise InvalidParameterError("task", f"only 'text-generation' is served, got {task!r}")
    for name in kw:
        if name in REFUSED:
            why, nearest = REFUSED[name]
            raise InvalidParameterError(name, f"not supported ({why}); the nearest supported option is {nearest}")
    known = set(option_names())
    for name in kw:
        if name not in known:
            raise InvalidParameterError(name, f"unknown option; serve() takes: {', '.join(option_names())}")
    for alias, ours in ALIASES.items():
        if alias in kw:
            value = kw.pop(alias)
            if kw.get(ours) is not None and kw[ours] != value:
                raise InvalidParameterError(alias, f"and {ours} name the same option: give one of them")
            kw[ours] = value
    enable_http = _flag(kw, "enable_http")
    if _flag(kw, "enable_rest"):                # the seed's: REST on `port`, the router on a free port
        if kw.get("http_port") is not None:
            raise InvalidParameterError("enable_rest", "puts the REST gateway on `port`: give port, not http_port "
                                        "(or enable_http=True with both ports)")
        enable_http = True
        kw["http_port"] = kw.get("port") if kw.get("port") is not None else 0
        kw["port"] = 0
    if _flag(kw, "enable_restful_api"):         # DeepSpeed-MII's: REST on restful_api_port (28080)
        enable_http = True
        if kw.get("http_port") is None:
            kw["http_port"] = MII_REST_PORT
    enable_terminate = _flag(kw, "enable_terminate")
    if enable_terminate and not enable_http:
        raise InvalidParameterError("enable_terminate", "turns on the gateway's GET /terminate: it needs the gateway "
                                    "(enable_http=True, enable_rest=True or enable_restful_api=True)")
    name = kw.pop("deployment_name", None)
    model = kw.pop("model", None)
    return ServeOptions(model, name, enable_http, enable_terminate, {k: v for k, v in kw.items() if v is not None
                                                                     or k not in ("port", "http_port")})


def _flag(kw: dict[str, Any], name: str) -> bool:
    v = kw.pop(name, False)
    if not isinstance(v, bool):
        raise InvalidParameterError(name, f"must be true or false, got {v!r}")
    return v
