"""`mii-async bench` (also `python -m mii_async.bench`): a serving benchmark against a running deployment, or
against a model it starts itself, with vLLM's metric definitions (docs/benchmarks.md says how to read them).

    mii-async bench --num-prompts 200 --input-len 64 512 --output-len 32 256 --request-rate 4
    mii-async bench --target tcp://127.0.0.1:5555 --request-rate 1,2,4,inf --plot-dir plots --result-json r.json
    mii-async bench --target http://127.0.0.1:8000 --dataset sharegpt --dataset-path sharegpt.json
    mii-async bench --target ws://127.0.0.1:8000 --goodput ttft:1000 tpot:100 --baseline hf
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import Any

from ..errors import InvalidParameterError, MIIAsyncError
from .arrivals import arrival_offsets
from .metrics import parse_goodput, summarize
from .targets import RequestRecord, make_target, sampling
from .workload import BenchRequest, prompts_file_requests, random_requests, sharegpt_requests


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidParameterError("request_rate", f"must be numbers separated by commas (inf: all at once), "
                                    f"got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise InvalidParameterError("request_rate", f"every rate must be > 0, got {text!r}")
    return rates


def _lens(param: str, xs: list[int]) -> tuple[int, int]:
    if len(xs) not in (1, 2):
        raise InvalidParameterError(param, "takes one length or MIN MAX")
    return (xs[0], xs[-1])


async def run_once(target: Any, requests: list[BenchRequest], *, rate: float, burstiness: float, seed: int,
                   max_concurrency: int | None, ignore_eos: bool, temperature: float,
                   progress: bool) -> tuple[list[RequestRecord], float]:
    """Sends every request at its arrival time (at most `max_concurrency` in flight); returns the records
    and the start time (perf_counter)."""
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=f"rate {rate:g}", unit="req", disable=not progress, file=sys.stderr)
    t0 = time.perf_counter()

    async def one(req: BenchRequest, at: float) -> RequestRecord:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            rec = await target.send(req, sampling(req, ignore_eos, temperature))
        else:
            async with gate:
                rec = await target.send(req, sampling(req, ignore_eos, temperature))
        bar.update(1)
        return rec

    records = list(await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets))))
    bar.close()
    return records, t0


def build_requests(a: argparse.Namespace, tokenizer: Any, context: int | None) -> list[BenchRequest]:
    if a.dataset == "random":
        reqs = random_requests(a.num_prompts, _lens("input_len", a.input_len), _lens("output_len", a.output_len),
                               prefix_len=a.prefix_len, seed=a.seed, vocab_size=len(tokenizer),
                               special_ids=tokenizer.all_special_ids)
    elif not a.dataset_path:
        raise InvalidParameterError("dataset_path", f"--dataset {a.dataset} needs --dataset-path")
    elif a.dataset == "sharegpt":
        reqs = sharegpt_requests(a.dataset_path, a.num_prompts, tokenizer, seed=a.seed,
                                 output_len=a.output_len[0] if a.output_len_given else None)
    else:
        reqs = prompts_file_requests(a.dataset_path, a.num_prompts, tokenizer, a.output_len[0])
    if context is not None:
        worst = max(reqs, key=lambda r: r.prompt_len + r.output_len)
        if worst.prompt_len + worst.output_len > context:
            raise InvalidParameterError("input_len" if a.dataset == "random" else "output_len",
                                        f"a request of {worst.prompt_len} prompt + {worst.output_len} output "
                                        f"tokens exceeds the model's context of {context} tokens")
    return reqs


def _engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    opts = {"dtype": a.dtype, "device": a.device, "max_num_seqs": a.max_num_seqs,
            "max_batch_tokens": a.max_batch_tokens, "kv_cache_memory": a.kv_cache_memory}
    return {k: v for k, v in opts.items() if v is not None}


def _print_table(run: dict[str, Any], percentiles: list[float]) -> None:
    rows = [("Request rate", f"{run['request_rate']:g} req/s" + (f", at most {run['max_concurrency']} in flight"
                                                                 if run.get("max_concurrency") else "")),
            ("Successful requests", run["completed"]), ("Failed requests", run["failed"]),
            ("Duration (s)", f"{run['duration_s']:.2f}"), ("Total input tokens", run["total_input_tokens"]),
            ("Prompt tokens from the prefix cache", "not reported" if run["total_cached_prompt_tokens"] is None
             else run["total_cached_prompt_tokens"]),
            ("Total output tokens", run["total_output_tokens"]),
            ("Request throughput (req/s)", f"{run['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{run['output_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{run['total_token_throughput']:.1f}")]
    if "request_goodput" in run:
        rows.append(("Request goodput (req/s)", f"{run['request_goodput']:.2f}"))
    for sla in (2, 4, 6):
        rows.append((f"FastGen effective throughput, {sla} tok/s (req/s)",
                     f"{run[f'fastgen_effective_throughput_{sla}tok_s']:.2f} "
                     f"({100 * run[f'fastgen_sla_met_fraction_{sla}tok_s']:.0f}% met)"))
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        cells = [f"mean {run[f'mean_{name}_ms']:.1f}", f"median {run[f'median_{name}_ms']:.1f}"]
        cells += [f"p{p:g} {run[f'p{p:g}_{name}_ms']:.1f}" for p in percentiles]
        rows.append((f"{title} (ms)", "  ".join(cells)))
    print(f"{' Serving benchmark ':=^78}")
    for k, v in rows:
        print(f"{k:<46}{v}")
    if run["errors"]:
        print(f"{'First errors':<46}{'; '.join(run['errors'][:3])[:200]}")
    print("=" * 78, flush=True)


def _load_tokenizer(a: argparse.Namespace) -> tuple[Any, str, int | None]:
    from transformers import AutoConfig, AutoTokenizer

    from ..config import default_cache_dir
    from ..model_source import resolve_model

    path = str(resolve_model(a.tokenizer or a.model, default_cache_dir()))
    cfg = AutoConfig.from_pretrained(path)
    context = a.max_model_len or getattr(cfg, "max_position_embeddings", None)
    return AutoTokenizer.from_pretrained(path), path, context


async def _bench(a: argparse.Namespace, target: Any, reqs: list[BenchRequest], rates: list[float],
                 slos: dict[str, float], percentiles: list[float]) -> tuple[dict[str, Any], list[Any]]:
    try:
        info = await target.open()
        if a.warmup:                              # one short request: connections, graphs and caches warm
            warm = reqs[0]._replace(output_len=min(8, reqs[0].output_len))
            rec = await target.send(warm, sampling(warm, a.ignore_eos, a.temperature))
            if rec.error:
                raise InvalidParameterError("target", f"the warm-up request failed: {rec.error}")
        runs, raw = [], []
        for rate in rates:
            forgotten = await _reset_prefix_cache(target) if a.reset_prefix_cache else None
            records, t0 = await run_once(target, reqs, rate=rate, burstiness=a.burstiness, seed=a.seed,
                                         max_concurrency=a.max_concurrency, ignore_eos=a.ignore_eos,
                                         temperature=a.temperature, progress=not a.no_progress)
            run = {"request_rate": rate, "burstiness": a.burstiness, "max_concurrency": a.max_concurrency,
                   "prefix_blocks_forgotten": forgotten,
                   **summarize(records, t0, goodput=slos, percentiles=percentiles, ema_span=a.ema_span)}
            runs.append(run)
            raw.append((records, t0))
            _print_table(run, percentiles)
    finally:
        await target.close()
    return {"target": target.label, **info, "runs": runs}, raw


async def _reset_prefix_cache(target: Any) -> int:
    try:
        return await target.reset_prefix_cache()
    except MIIAsyncError as exc:
        raise InvalidParameterError("reset_prefix_cache", f"the target could not reset its prefix cache ({exc}); "
                                    "--no-reset-prefix-cache measures without the reset") from None


def main(argv: list[str] | None = None) -> int:
    a = build_parser(argparse.ArgumentParser(prog="mii-async bench")).parse_args(argv)
    try:
        return _main(a)
    except MIIAsyncError as exc:
        print(f"mii-async bench: {exc}", file=sys.stderr)
        return 2


def _main(a: argparse.Namespace) -> int:
    rates = _rates(a.request_rate)
    a.output_len_given = a.output_len is not None
    a.output_len = a.output_len or [16, 128]
    for name in ("ema_span", "baseline_batch_size"):
        if getattr(a, name) < 1:
            raise InvalidParameterError(name, f"must be at least 1, got {getattr(a, name)}")
    slos = parse_goodput(a.goodput)
    percentiles = [float(p) for p in a.metric_percentiles.split(",")]
    if any(not 0 < p <= 100 for p in percentiles):
        raise InvalidParameterError("metric_percentiles", f"must be in (0, 100], got {a.metric_percentiles!r}")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise InvalidParameterError("max_concurrency", f"must be at least 1, got {a.max_concurrency}")
    if a.baseline not in (None, "hf"):
        raise InvalidParameterError("baseline", f"the only baseline is 'hf', got {a.baseline!r}")
    if a.baseline and a.target and not a.model:
        raise InvalidParameterError("model", "--baseline hf with --target needs --model: the served model's "
                                    "directory, whose weights the baseline loads")
    if a.target and a.model and not a.tokenizer:
        a.tokenizer = a.model                    # the served model's directory: its tokenizer and weights
    tokenizer, model_dir, context = _load_tokenizer(a)
    reqs = build_requests(a, tokenizer, context)
    started = None
    if a.target:
        target = make_target(a.target, api_key=a.api_key or os.environ.get("MII_ASYNC_API_KEY"),
                             curve_dir=a.curve_dir, model_name=a.served_model_name,
                             connect_timeout_s=a.connect_timeout)
    else:
        import mii_async

        from .targets import RouterTarget

        print(f"mii-async bench: starting {a.model or 'the default model'} (router + 1 worker process)",
              file=sys.stderr, flush=True)
        started = mii_async.serve(a.model, **_engine_kwargs(a))
        target = RouterTarget(started.address, client=started)
    try:
        result, raw = asyncio.run(_bench(a, target, reqs, rates, slos, percentiles))
    finally:
        if started is not None:
            started.terminate_server_sync()
            started.close()
    result.update(dataset=a.dataset, num_prompts=len(reqs), seed=a.seed, ignore_eos=a.ignore_eos,
                  temperature=a.temperature, input_len=a.input_len, output_len=a.output_len, prefix_len=a.prefix_len,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"))
    if a.baseline == "hf":
        from .hf_baseline import run_hf

        print("mii-async bench: running transformers generate on the same prompts", file=sys.stderr, flush=True)
        base = run_hf(model_dir, reqs, device=a.device or "auto", dtype=a.dtype or "auto",
                      batch_size=a.baseline_batch_size)
        best = max(r["output_throughput"] for r in result["runs"])
        result["baseline"] = base
        result["output_throughput_vs_baseline"] = best / base["output_throughput"]
        print(f"HF generate (static batches of {base['batch_size']}): {base['output_throughput']:.1f} output tok/s "
              f"in {base['seconds']:.2f} s; ours, best rate: {best:.1f} tok/s = "
              f"{result['output_throughput_vs_baseline']:.2f}x", flush=True)
    if a.plot_dir:
        from .plots import run_figures, sweep_figure

        plots = []
        for run, (records, t0) in zip(result["runs"], raw):
            plots += run_figures(records, t0, a.plot_dir, f"rate {run['request_rate']:g}" if len(rates) > 1 else "")
        if len(rates) > 1:
            plots.append(sweep_figure(result["runs"], a.plot_dir))
        result["plots"] = plots
        print(f"mii-async bench: plots in {a.plot_dir}: {', '.join(os.path.basename(p) for p in plots)}")
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump(result, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
        print(f"mii-async bench: results in {a.result_json}")
    return 0 if all(r["completed"] for r in result["runs"]) else 1


def build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.description = "A serving benchmark: TTFT, TPOT, ITL, E2E latency, throughput, goodput, effective throughput"
    t = p.add_argument_group("target (default: start --model here: a router and one worker process)")
    t.add_argument("--target", default=None, help="tcp://HOST:PORT (the router), http://HOST:PORT (the gateway's "
                   "OpenAI API) or ws://HOST:PORT (its WebSocket)")
    t.add_argument("--model", default=None, help="the model to start, or the served model's directory (tokenizer "
                   "and the HF baseline's weights); default: SmolLM2-135M-Instruct")
    t.add_argument("--tokenizer", default=None, help="a model directory whose tokenizer to use (default: --model's)")
    t.add_argument("--api-key", default=None, help="for the gateway (default: $MII_ASYNC_API_KEY)")
    t.add_argument("--curve-dir", default=None)
    t.add_argument("--connect-timeout", type=float, default=10.0, help="seconds the target has to answer")
    t.add_argument("--served-model-name", default=None, help="the OpenAI model name (default: the first listed)")
    for name in ("--dtype", "--device"):
        t.add_argument(name, default=None)
    for name in ("--max-num-seqs", "--max-batch-tokens", "--max-model-len"):
        t.add_argument(name, type=int, default=None)
    t.add_argument("--kv-cache-memory", type=float, default=None, help="GiB of KV pool for the model started here")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=("random", "sharegpt", "prompts"), default="random")
    w.add_argument("--dataset-path", default=None, help="a ShareGPT JSON file, or a prompts file (.txt, .jsonl)")
    w.add_argument("--num-prompts", type=int, default=100)
    w.add_argument("--input-len", type=int, nargs="+", default=[32, 256], metavar="N",
                   help="random prompts: a length or MIN MAX, uniform (default 32 256)")
    w.add_argument("--output-len", type=int, nargs="+", default=None, metavar="N",
                   help="output tokens: a length or MIN MAX (default 16 128; sharegpt: the reply's length)")
    w.add_argument("--prefix-len", type=int, default=0, help="random prompts: shared prefix tokens (prefix cache)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length (default: yes)")
    w.add_argument("--temperature", type=float, default=0.0)
    s = p.add_argument_group("arrivals")
    s.add_argument("--request-rate", default="inf", help="requests/s, or a comma list to sweep; inf: all at once")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 is Poisson")
    s.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    s.add_argument("--reset-prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="before each run the target forgets its cached prefixes, so that a sweep's later rates "
                        "(the same prompts) and the warm-up hit nothing a run did not compute itself")
    s.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one short request before timing (default: yes)")
    m = p.add_argument_group("metrics and results")
    m.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50")
    m.add_argument("--metric-percentiles", default="90,99", help="besides mean and median")
    m.add_argument("--ema-span", type=int, default=16, help="FastGen generation SLA: the EMA's span in tokens")
    m.add_argument("--baseline", default=None, help="hf: transformers generate on the same prompts, this machine")
    m.add_argument("--baseline-batch-size", type=int, default=32)
    m.add_argument("--result-json", default=None, metavar="PATH")
    m.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG figures here (needs matplotlib)")
    m.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_main)
    return p
