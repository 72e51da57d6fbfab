"""`mii-async` command line: generate (streamed to stdout) and an interactive terminal chat."""
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
    args = parser.parse_args(argv)
    from .errors import MIIAsyncError

    try:
        return args.func(args)
    except MIIAsyncError as exc:
        print(f"mii-async: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
