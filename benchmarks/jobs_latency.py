"""Interactive latency while a batch runs, and a batch's throughput, on one deployment with its gateway.

    python -m benchmarks.jobs_latency [--model PATH] [--interactive 20] [--lines 200] [--max-tokens 32]
        [--chat-tokens 16] [--max-background-per-replica N] [--json out.json]

Three phases on one deployment (the default model on the CPU unless told otherwise):

1. idle: `--interactive` short chats, one after another, streamed through /v1/chat/completions; TTFT is the
   time from sending one to its first chunk with text. As many again once the batch has finished: the idle
   figure is of both, so that a change in the host's other load during the run weighs on both sides alike.
2. loaded: a batch of `--lines` completions (max_tokens `--max-tokens`, greedy, ignore_eos) through /v1/files
   and /v1/batches; while it runs, the same chats one after another. Only chats that ended before the batch
   did count. The batch's wall time runs from POST /v1/batches to the poll that finds it completed; its output
   tokens are summed from the output file's usage.
3. at once: the same lines' bodies sent all together through /v1/completions (interactive priority, no batch
   bound), timed to the last answer.

The target: interactive TTFT p50 while the batch runs at most 1.5× the idle p50.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from typing import Any

import httpx

import mii_async

TARGET_RATIO = 1.5


def _pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of `xs`, nearest rank; nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def chat_ttft(http: httpx.AsyncClient, i: int, max_tokens: int) -> float:
    """Seconds from sending a short streamed chat to its first chunk with text; the stream is read to its end."""
    body = {"messages": [{"role": "user", "content": f"Say hello to friend number {i}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.perf_counter() - t0
    assert first is not None, "a chat streamed no text"
    return first


def batch_lines(n: int, max_tokens: int) -> list[dict]:
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"Write a short note about topic number {i}:", "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": True}} for i in range(n)]


async def run_batch_with_probes(http: httpx.AsyncClient, lines: list[dict], probes: int,
                                chat_tokens: int) -> dict[str, Any]:
    """Submits `lines` as a batch, measures chat TTFTs while it runs, then waits for it to finish."""
    f = (await http.post("/v1/files", files={"file": ("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines))},
                         data={"purpose": "batch"})).json()
    t0 = time.perf_counter()
    b = (await http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                              "completion_window": "24h"})).json()
    done: dict[str, Any] = {}

    async def watch() -> None:
        while True:
            cur = (await http.get(f"/v1/batches/{b['id']}")).json()
            if cur["status"] in ("completed", "failed", "cancelled"):
                done.update(cur, wall_s=time.perf_counter() - t0)
                return
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    ttfts: list[float] = []
    while len(ttfts) < probes and not done:
        t = await chat_ttft(http, 1000 + len(ttfts), chat_tokens)
        if not done:                                  # the batch still ran when this chat ended
            ttfts.append(t)
    await watcher
    assert done["status"] == "completed", done
    out = (await http.get(f"/v1/files/{done['output_file_id']}/content")).text.splitlines()
    tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in out)
    return {"ttft_s": ttfts, "wall_s": done["wall_s"], "lines": len(out), "output_tokens": tokens,
            "failed": done["request_counts"]["failed"]}


async def run_at_once(http: httpx.AsyncClient, lines: list[dict]) -> dict[str, Any]:
    """The lines' bodies sent together through /v1/completions, timed to the last answer."""
    t0 = time.perf_counter()
    answers = await asyncio.gather(*(http.post("/v1/completions", json=x["body"]) for x in lines))
    wall = time.perf_counter() - t0
    for a in answers:
        a.raise_for_status()
    return {"wall_s": wall, "lines": len(answers),
            "output_tokens": sum(a.json()["usage"]["completion_tokens"] for a in answers)}


async def measure(url: str, client: Any, a: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=a.lines + 16, max_keepalive_connections=a.lines + 16)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        for i in range(3):                                   # warm-up: first steps of each shape
            await chat_ttft(http, i, a.chat_tokens)
        before = [await chat_ttft(http, 100 + i, a.chat_tokens) for i in range(a.interactive)]
        lines = batch_lines(a.lines, a.max_tokens)
        loaded = await run_batch_with_probes(http, lines, a.interactive, a.chat_tokens)
        background = (await client.health())["background"]
        after = [await chat_ttft(http, 200 + i, a.chat_tokens) for i in range(a.interactive)]
        at_once = await run_at_once(http, lines)
    idle = before + after               # idle both sides of the batch: a drift of the host's load falls on both
    p50_idle, p50_loaded = _pct(idle, 0.5), _pct(loaded["ttft_s"], 0.5)
    return {
        "interactive": {"idle_ms": {"p50": p50_idle * 1e3, "p99": _pct(idle, 0.99) * 1e3, "n": len(idle),
                                    "p50_before": _pct(before, 0.5) * 1e3, "p50_after": _pct(after, 0.5) * 1e3},
                        "loaded_ms": {"p50": p50_loaded * 1e3, "p99": _pct(loaded["ttft_s"], 0.99) * 1e3,
                                      "n": len(loaded["ttft_s"])},
                        "p50_ratio": p50_loaded / p50_idle, "target_ratio": TARGET_RATIO,
                        "met": p50_loaded <= TARGET_RATIO * p50_idle},
        "batch": _throughput(loaded) | {"failed": loaded["failed"]},
        "at_once": _throughput(at_once),
        "router_background": background,
        "config": {"model": a.model or "default", "interactive": a.interactive, "lines": a.lines,
                   "max_tokens": a.max_tokens, "chat_tokens": a.chat_tokens,
                   "max_background_per_replica": a.max_background_per_replica},
    }


def _throughput(run: dict[str, Any]) -> dict[str, float]:
    return {"lines": run["lines"], "wall_s": run["wall_s"], "lines_s": run["lines"] / run["wall_s"],
            "output_tok_s": run["output_tokens"] / run["wall_s"]}


def table(r: dict[str, Any]) -> str:
    i, b, o = r["interactive"], r["batch"], r["at_once"]
    rows = [("interactive TTFT idle", f"p50 {i['idle_ms']['p50']:.0f} ms, p99 {i['idle_ms']['p99']:.0f} ms "
                                      f"(n={i['idle_ms']['n']}; p50 before the batch {i['idle_ms']['p50_before']:.0f}, "
                                      f"after {i['idle_ms']['p50_after']:.0f})"),
            ("interactive TTFT, batch running", f"p50 {i['loaded_ms']['p50']:.0f} ms, "
                                                f"p99 {i['loaded_ms']['p99']:.0f} ms (n={i['loaded_ms']['n']})"),
            ("p50 loaded / idle", f"{i['p50_ratio']:.2f}x (target <= {TARGET_RATIO}x: "
                                  f"{'met' if i['met'] else 'NOT met'})"),
            ("batch (/v1/batches)", f"{b['lines']} lines in {b['wall_s']:.1f} s: {b['lines_s']:.2f} lines/s, "
                                    f"{b['output_tok_s']:.0f} output tok/s"),
            ("same lines at once (/v1/completions)", f"{o['lines']} lines in {o['wall_s']:.1f} s: {o['lines_s']:.2f} "
                                                     f"lines/s, {o['output_tok_s']:.0f} output tok/s"),
            ("router: background peak / bound", ", ".join(
                f"replica {k}: {v['peak']} / {v['bound']}" for k, v in r["router_background"]["replicas"].items()))]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.jobs_latency", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model directory or name (default: the default model)")
    ap.add_argument("--interactive", type=int, default=20, help="chats measured idle, and again under load")
    ap.add_argument("--lines", type=int, default=200, help="batch lines")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each batch line")
    ap.add_argument("--chat-tokens", type=int, default=16, help="max_tokens of each interactive chat")
    ap.add_argument("--max-background-per-replica", type=int, default=None,
                    help="the router's bound on background requests in flight per replica (default: its own)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    a = ap.parse_args(argv)
    opts: dict[str, Any] = {}
    if a.max_background_per_replica is not None:
        opts["max_background_per_replica"] = a.max_background_per_replica
    with tempfile.TemporaryDirectory(prefix="jobs-latency-") as jobs_dir:
        client = mii_async.serve(a.model, enable_http=True, http_port=0, jobs_dir=jobs_dir, **opts)
        try:
            r = client.run(measure(client.http_url, client, a))
        finally:
            client.terminate_server_sync(drain_s=0)
    print(table(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
