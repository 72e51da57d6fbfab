"""`mii-async` command line: serve a deployment, join one as a worker, generate, chat, make CURVE keys."""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from typing import Any

from .cli_http import add_http_args, gateway_config, http_fields


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory, repo id in the local HF cache, or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--quantization", default=None, choices=["fp8", "int4"],
                   help="as for serve (default: int4 on the CPU for a 4-bit GGUF when no --dtype is given)")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default: the CPUs it may use)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _params(a: argparse.Namespace) -> dict[str, Any]:
    """The sampling options, validated before the model loads."""
    from .params import SamplingParams

    params = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    SamplingParams.from_kwargs(**params)
    return params


async def _print_stream(pipe: Any, prompt: Any, params: dict[str, Any]) -> str:
    text = []
    async for chunk in pipe.stream(prompt, **params):
        print(chunk.text, end="", flush=True)
        text.append(chunk.text)
        if chunk.finish_reason == "error":
            print(f"\n[error: {chunk.error}]", file=sys.stderr)
    print()
    return "".join(text)


def _generate(a: argparse.Namespace) -> int:
    import mii_async

    params = _params(a)
    with mii_async.pipeline(a.model, dtype=a.dtype, device=a.device, quantization=a.quantization,
                            threads=a.threads) as pipe:
        prompt: Any = a.prompt if a.raw else [{"role": "user", "content": a.prompt}]
        asyncio.run(_print_stream(pipe, prompt, params))
    return 0


def _chat(a: argparse.Namespace) -> int:
    import mii_async

    params = _params(a)
    with mii_async.pipeline(a.model, dtype=a.dtype, device=a.device, quantization=a.quantization,
                            threads=a.threads) as pipe:
        history: list[dict[str, str]] = []
        print("mii-async chat: type a message, an empty line or Ctrl-D to quit.")
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                break
            if not line:
                break
            history.append({"role": "user", "content": line})
            while True:
                try:
                    answer = asyncio.run(_print_stream(pipe, history, params))
                    break
                except mii_async.InvalidParameterError as exc:   # the conversation outgrew the context
                    if len(history) > 2:                          # forget the oldest turn, and try again
                        del history[:2]
                        print("mii-async: (the oldest turn was forgotten: the chat outgrew the context)",
                              file=sys.stderr)
                        continue
                    history.pop()
                    print(f"mii-async: {exc} (that message was not sent; the chat goes on)", file=sys.stderr)
                    answer = None
                    break
            if answer is not None:
                history.append({"role": "assistant", "content": answer})
    return 0


def _serve(a: argparse.Namespace) -> int:
    import json
    import logging
    import os

    from .config import HttpConfig, split_serve_kwargs
    from .gateway.main import API_KEY_ENV
    from .lifecycle import run_uvloop
    from .router.main import run_router

    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    os.environ["MII_ASYNC_LOG_LEVEL"] = a.log_level          # the workers and the gateway start with it
    serve, engine = split_serve_kwargs(a.model, dict(
        replicas=a.replicas, tensor_parallel=a.tensor_parallel, host=a.host, port=a.port, worker_host=a.worker_host,
        worker_port=a.worker_port, max_queued_requests=a.max_queued_requests, drain_timeout_s=a.drain_timeout,
        curve_dir=a.curve_dir, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
        quantization=a.quantization,
        **{k: v for k in ("threads", "kv_cache_memory", "kv_cache_dtype", "gpu_memory_utilization",
                          "max_batch_tokens", "max_mixed_batch_tokens", "max_num_seqs", "step_token_multiple")
           if (v := getattr(a, k)) is not None},
        **({"cuda_graphs": False} if a.enforce_eager else {})))
    http = None
    if not a.no_http:
        http = HttpConfig(**http_fields(a), api_key=a.api_key or os.environ.get(API_KEY_ENV) or None)
        if http.http_port:                          # fail before the model loads, not after
            from .gateway.main import bind

            bind(http.http_host, http.http_port).close()
    gateway: list = []
    failed: list[str] = []
    stopping = threading.Event()
    watchers: list[threading.Thread] = []
    stopper: list = []                              # the router's own stop: a drain, never a cut-short one
    keys: list[str] = []                            # the mesh's keys directory, once the router has it

    def start_gateway(router_address: str) -> None:
        from .deployment import GatewayProcess

        try:
            gw = GatewayProcess(router_address, http, keys[0], serve.drain_timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported, then the deployment stops
            failed.append(str(exc))
            print(f"mii-async: the gateway could not start: {exc}", file=sys.stderr, flush=True)
            stopper[0]()
            return
        gateway.append(gw)
        key = " (API key required)" if http.api_key else ""
        print(f"mii-async: chat page at {gw.url}/ · OpenAI API at {gw.url}/v1 · WebSocket at "
              f"{gw.url.replace('http', 'ws', 1)}/v1/ws{key}", flush=True)
        watch = threading.Thread(target=_keep_gateway,
                                 args=(gateway, router_address, http, serve, keys[0], stopping, failed, stopper[0]),
                                 name="mii_async-gateway-watch", daemon=True)
        watchers.append(watch)
        watch.start()

    def on_ready(status: dict) -> None:
        if "error" in status:                       # one line, as for a bad option (the log has the rest)
            if not status.get("stopped"):           # a Ctrl-C while it started is no failure
                failed.append(status["error"])
            print(f"mii-async: {status['error']}", file=sys.stderr, flush=True)
            return
        print(f"mii-async: serving {status['model']} on {status['address']} "
              f"(workers join at {status['worker_address']})", flush=True)
        if a.status_json:
            print(json.dumps(status), flush=True)
        keys.append(status["curve_dir"])
        if http is not None:
            address = status["address"].replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
            asyncio.get_running_loop().run_in_executor(None, start_gateway, address)

    try:
        code = run_uvloop(run_router(serve, engine, on_ready, on_stopper=stopper.append))
    finally:
        stopping.set()
        for gw in gateway:
            gw.stop(10.0)
        for watch in watchers:                      # a restart in progress ends; then it is stopped too
            watch.join(130.0)
        for gw in gateway:
            gw.stop(10.0)
    return 2 if failed else code


def _keep_gateway(gateway: list, router_address: str, http, serve, keys_dir: str, stopping: threading.Event,
                  failed: list[str], stop) -> None:
    """Restarts the gateway on its port when it dies (it holds no state: a client of the router); if it dies
    within 10 s of each of three restarts running, the deployment stops (exit 2), so that a supervisor can
    act; `stop` drains as a first Ctrl-C does, and leaves a drain in progress to finish. An exit with status 0
    is a stop the deployment asked for (the gateway leaves signals to `serve`)."""
    import dataclasses
    import time

    from .deployment import GatewayProcess

    http = dataclasses.replace(http, http_port=int(gateway[-1].url.rsplit(":", 1)[1]))   # the same URL
    quick = 0
    while True:
        gw, started = gateway[-1], time.monotonic()
        if gw.child.proc.wait() == 0 or stopping.is_set():
            return
        quick = quick + 1 if time.monotonic() - started < 10 else 0
        print(f"mii-async: the gateway exited ({gw.child.describe_exit()}); "
              + ("restarting it" if quick < 3 else "it keeps failing: stopping"), file=sys.stderr, flush=True)
        if quick >= 3:
            break
        if stopping.wait(1.0):
            return
        try:
            gateway.append(GatewayProcess(router_address, http, keys_dir, serve.drain_timeout_s))
        except Exception as exc:  # noqa: BLE001 - reported, then the deployment stops
            print(f"mii-async: the gateway could not restart: {exc}", file=sys.stderr, flush=True)
            break
        if stopping.is_set():                       # stopped while it restarted: `serve` stops it
            return
    failed.append("the gateway failed")
    stop()


def _gateway(a: argparse.Namespace) -> int:
    from .gateway.main import main as gateway_main

    argv = ["--router", a.router, "--config", gateway_config(a)] + (["--curve-dir", a.curve_dir] if a.curve_dir else [])
    return gateway_main(argv + ["--log-level", a.log_level] + (["--tokenizer", a.tokenizer] if a.tokenizer else []))


def _worker(a: argparse.Namespace) -> int:
    from mii_async.workers.main import run

    return run(a)


def _keys(a: argparse.Namespace) -> int:
    from .mesh_keys import make_keys

    make_keys(a.dir, force=a.force)
    print(f"mii-async: CURVE keys written to {a.dir} (server, client, operator and worker pairs: "
          "see docs/mesh.md for who needs which)")
    return 0


def _tp_arg(v: str) -> int | str:
    return v if v == "auto" else int(v)


def _serve_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="run a deployment: the router, its worker processes and the HTTP gateway")
    s.add_argument("model", nargs="?", default=None, help="as for generate (default: SmolLM2-135M-Instruct)")
    s.add_argument("--replicas", type=int, default=1, help="replicas to start here (0: wait for workers that join)")
    s.add_argument("--tensor-parallel", type=_tp_arg, default="auto", help="ranks per replica, or auto (default)")
    s.add_argument("--host", default="127.0.0.1", help="the clients' address (default: loopback only)")
    s.add_argument("--port", type=int, default=5555, help="the clients' port (0: any free one)")
    s.add_argument("--worker-host", default="127.0.0.1", help="the workers' address (a routable one lets hosts join)")
    s.add_argument("--worker-port", type=int, default=0)
    s.add_argument("--max-queued-requests", type=int, default=1024)
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds live requests get on SIGTERM")
    s.add_argument("--curve-dir", default=None, help="the mesh's CURVE keys (`mii-async keys DIR`); default: "
                   "keys made for this deployment, which local clients of this user find by port")
    s.add_argument("--dtype", default="auto")
    s.add_argument("--device", default="auto")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--quantization", default=None, choices=["fp8", "int4"],
                   help="fp8: linear weights in FP8 e4m3, quantized at load (GPU; an FP8 checkpoint loads as FP8 "
                        "without it); int4: 4-bit weights, bf16 activations (CPU; the default for a 4-bit GGUF "
                        "such as the default model's when no --dtype is given); docs/quantization.md")
    s.add_argument("--threads", type=int, default=None,
                   help="CPU: each worker's torch threads (default: the CPUs it may run on, shared among its ranks)")
    s.add_argument("--kv-cache-memory", type=float, default=None, help="GiB for each replica's KV pool (CPU)")
    s.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                   help="fp8: K and V cached as e4m3, twice the tokens in the same memory (the reference ops; "
                        "docs/quantization.md)")
    s.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="GPU: the share of the device a replica may use (default 0.9)")
    s.add_argument("--max-batch-tokens", type=int, default=None,
                   help="tokens per engine step (default: 512 on CPU, 2048 on a GPU)")
    s.add_argument("--max-mixed-batch-tokens", type=int, default=None,
                   help="tokens per step while requests are decoding: bounds the inter-token gap "
                        "(default: 1536 on a GPU, --max-batch-tokens on CPU)")
    s.add_argument("--step-token-multiple", type=int, default=None,
                   help="cut a step with prompt chunks to a multiple of this many tokens where its newest chunk "
                        "can give up the rest (the GEMMs' tile; default: 64 on a GPU, not cut on CPU; 1: not cut)")
    s.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests running at once per replica (default: 64 on CPU, 256 on a GPU)")
    s.add_argument("--enforce-eager", action="store_true",
                   help="GPU: no CUDA graphs (neither decode graphs nor the piecewise graphs of prompt steps)")
    add_http_args(s)
    s.add_argument("--no-http", action="store_true", help="no gateway: only the router's ZeroMQ socket")
    s.add_argument("--status-json", action="store_true", help="also print the ready status as one JSON line")
    s.add_argument("--log-level", **LOG_LEVEL)
    s.set_defaults(func=_serve)


LOG_LEVEL = dict(default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                 help="for every process of the deployment (default: INFO)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mii-async", description="Asyncio streaming LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream one answer to stdout")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    _engine_args(g)
    g.set_defaults(func=_generate)
    c = sub.add_parser("chat", help="multi-turn chat in the terminal")
    _engine_args(c)
    c.set_defaults(func=_chat)
    _serve_parser(sub)
    from mii_async.workers.main import build_parser

    w = build_parser(sub.add_parser("worker", help="join a router's mesh as a worker (on this or another host)"))
    w.set_defaults(func=_worker)
    gw = sub.add_parser("gateway", help="run an HTTP/WebSocket gateway in front of a running router")
    gw.add_argument("--router", required=True, help="the router's client address, e.g. tcp://127.0.0.1:5555")
    add_http_args(gw)
    gw.add_argument("--curve-dir", default=None)
    gw.add_argument("--tokenizer", default=None, help="the model directory, when the router's is not on this host")
    gw.add_argument("--log-level", **LOG_LEVEL)
    gw.set_defaults(func=_gateway)
    from .bench.serving import build_parser as bench_parser

    bench_parser(sub.add_parser("bench", help="a serving benchmark: latency, throughput, goodput, plots"))
    from .jobs.batch_cli import build_parser as batch_parser

    batch_parser(sub.add_parser("batch", help="the Batch API: submit a JSONL file of requests, follow it, fetch "
                                "its results, cancel it (docs/jobs.md)"))
    k = sub.add_parser("keys", help="make the CURVE key pairs of a deployment whose clients or workers run as "
                       "other users or on other hosts")
    k.add_argument("dir")
    k.add_argument("--force", action="store_true", help="replace keys already in DIR")
    k.set_defaults(func=_keys)
    args = parser.parse_args(argv)
    from .errors import MIIAsyncError

    try:
        return args.func(args)
    except MIIAsyncError as exc:
        print(f"mii-async: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
