"""`mii-async` command line: serve a deployment, join one as a worker, generate, chat, make CURVE keys."""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory, repo id in the local HF cache, or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
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
    with mii_async.pipeline(a.model, dtype=a.dtype, device=a.device) as pipe:
        prompt: Any = a.prompt if a.raw else [{"role": "user", "content": a.prompt}]
        asyncio.run(_print_stream(pipe, prompt, params))
    return 0


def _chat(a: argparse.Namespace) -> int:
    import mii_async

    params = _params(a)
    with mii_async.pipeline(a.model, dtype=a.dtype, device=a.device) as pipe:
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
            answer = asyncio.run(_print_stream(pipe, history, params))
            history.append({"role": "assistant", "content": answer})
    return 0


def _serve(a: argparse.Namespace) -> int:
    import json
    import logging

    from .config import split_serve_kwargs
    from .router.main import run_router, run_uvloop

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    serve, engine = split_serve_kwargs(a.model, dict(
        replicas=a.replicas, tensor_parallel=a.tensor_parallel, host=a.host, port=a.port, worker_host=a.worker_host,
        worker_port=a.worker_port, max_queued_requests=a.max_queued_requests, drain_timeout_s=a.drain_timeout,
        curve_dir=a.curve_dir, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
        **({"kv_cache_memory": a.kv_cache_memory} if a.kv_cache_memory is not None else {})))

    def on_ready(status: dict) -> None:
        if "error" not in status:
            print(f"mii-async: serving {status['model']} on {status['address']} "
                  f"(workers join at {status['worker_address']})", flush=True)
            if a.status_json:
                print(json.dumps(status), flush=True)

    return run_uvloop(run_router(serve, engine, on_ready))


def _worker(a: argparse.Namespace) -> int:
    from .workers.main import run

    return run(a)


def _keys(a: argparse.Namespace) -> int:
    from .transport import make_curve_keys

    make_curve_keys(a.dir)
    print(f"mii-async: CURVE keys written to {a.dir} (server.key*, client.key*, authorized/client.key)")
    return 0


def _tp_arg(v: str) -> int | str:
    return v if v == "auto" else int(v)


def _serve_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="run a deployment: the router and its worker processes")
    s.add_argument("model", nargs="?", default=None, help="as for generate (default: SmolLM2-135M-Instruct)")
    s.add_argument("--replicas", type=int, default=1, help="replicas to start here (0: wait for workers that join)")
    s.add_argument("--tensor-parallel", type=_tp_arg, default="auto", help="ranks per replica, or auto (default)")
    s.add_argument("--host", default="127.0.0.1", help="the clients' address (default: loopback only)")
    s.add_argument("--port", type=int, default=5555, help="the clients' port (0: any free one)")
    s.add_argument("--worker-host", default="127.0.0.1", help="the workers' address (a routable one lets hosts join)")
    s.add_argument("--worker-port", type=int, default=0)
    s.add_argument("--max-queued-requests", type=int, default=1024)
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds live requests get on SIGTERM")
    s.add_argument("--curve-dir", default=None, help="CURVE keys from `mii-async keys DIR` (needed off loopback)")
    s.add_argument("--dtype", default="auto")
    s.add_argument("--device", default="auto")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--kv-cache-memory", type=float, default=None, help="GiB for each replica's KV pool (CPU)")
    s.add_argument("--status-json", action="store_true", help="also print the ready status as one JSON line")
    s.add_argument("--log-level", default="INFO")
    s.set_defaults(func=_serve)


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
    from .workers.main import build_parser

    w = build_parser(sub.add_parser("worker", help="join a router's mesh as a worker (on this or another host)"))
    w.set_defaults(func=_worker)
    k = sub.add_parser("keys", help="make CURVE key pairs for a deployment that leaves loopback")
    k.add_argument("dir")
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
