"""The mixed load (1,000 requests, inputs in [64, 1024], outputs in [64, 512], all at once) on an
in-process engine, with its step log; and sweeps of it over scheduler settings and decode-attention widths in one
process, the variants interleaved (python -m benchmarks.llama8b --only mixed …)."""
from __future__ import annotations

import dataclasses
import itertools
import random
import time

import torch

from .engine_drain import drain
from .kernel_variants import Variant, capture_variant, use_variant, variant_config
from .step_log import StepLog
from .token_prompts import prompts


def mixed_sweep(engine, budgets: list[int | None], multiples: list[int], repeat: int, early: bool = True,
                warps: list[int | None] = (None,), num_seqs: list[int | None] = (None,),
                pieces: list[int | None] = (None,), grids: list[str | None] = (None,)) -> dict:
    """The mixed load once per (repeat, decode-attention width, decode grid order, piecewise graphs on / off,
    max_num_seqs, mixed budget, step token multiple), the variants interleaved so that the device's drift
    (power cap, clocks) falls on all of them alike; the scheduler's `max_num_seqs`, `max_mixed_batch_tokens`
    and `step_token_multiple` (0: not cut) are set between runs. None keeps the engine's. Each (width, grid
    order) is a KernelConfig of its own, with decode graphs captured of its own (kernel_variants.py)."""
    sched, runner = engine.scheduler, engine.runner
    start, runs = sched.config, {}
    start_pieces = runner.piecewise
    base = engine.model.ops.config
    decode = list(itertools.product(warps, grids))
    variants = {wg: capture_variant(engine, variant_config(base, *wg)) for wg in decode}
    own = Variant(engine.model.ops, runner.graphs)
    mixed(engine, n=64, early=early)             # warm-up: the first eager steps of each shape
    try:
        for r in range(repeat):
            for w, gr in decode:
                use_variant(engine, variants[w, gr])
                for pw, q, b, m in itertools.product(pieces, num_seqs, budgets, multiples):
                    runner.piecewise = start_pieces if pw is None or pw else None
                    sched.config = dataclasses.replace(
                        start, max_mixed_batch_tokens=min(b or start.max_mixed_batch_tokens, start.max_batch_tokens),
                        step_token_multiple=m or 1, max_num_seqs=q or start.max_num_seqs)
                    name = (f"budget {b if b is not None else 'default'} multiple {m}"   # as asked: unique
                            + (f" seqs {q}" if q is not None else "") + (f" warps {w}" if w is not None else "")
                            + (f" grid {gr}" if gr is not None else "") + (f" pieces {pw}" if pw is not None else ""))
                    runs[f"{name} #{r}"] = res = mixed(engine, early=early)
                    print(f"mixed {name} run {r}: {res['output_tok_s']:.0f} tok/s, ITL p50 / p99 "
                          f"{res['itl_ms_p50']:.1f} / {res['itl_ms_p99']:.1f} ms, TTFT p50 "
                          f"{res['ttft_ms_p50']:.0f} ms", flush=True)
    finally:
        sched.config, runner.piecewise = start, start_pieces
        use_variant(engine, own)
    return runs


def mixed(engine, n: int = 1000, early: bool = True) -> dict:
    """n requests, inputs in [64, 1024], outputs in [64, 512], all submitted at once. `step_log`: the slowest
    engine steps and the garbage collector's pauses (what the ITL tail is made of). `preemptions`: sequences
    the KV pool could not hold; their recompute finds their blocks in the prefix cache, so `prefix_hit_tokens`
    counts it (the prompts share no prefix)."""
    rng = random.Random(5)
    reqs = [(p, rng.randint(64, 512)) for p in prompts(n, 64, 1024, 6)]
    engine.reset_prefix_cache()                  # a rerun finds none of its prompts cached
    before = engine.stats()                      # prefix hits and preemptions are counted over this run
    sched, schedule = engine.scheduler, engine.scheduler.schedule
    runner, sampler = engine.runner, engine.sampler
    execute, sample = runner.execute, sampler.launch
    parts: dict[str, float] = {}                 # the current launch's host seconds: schedule, execute, sample;
                                                 # and inside execute, its attention calls and graph replays

    def timed(name, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
        return run

    def timed_execute(plan, ids=None, between_layers=None):
        """`execute`'s host time, less the reads of the step in flight that it calls (their own part)."""
        def read(t=time.perf_counter):
            a = t()
            between_layers()
            parts["early_read"] = parts.get("early_read", 0.0) + t() - a
        t = time.perf_counter()
        try:
            return execute(plan, ids, read if between_layers is not None else None)
        finally:
            parts["execute"] = parts.get("execute", 0.0) + time.perf_counter() - t - parts.get("early_read", 0.0)

    def logged():
        plan = schedule()
        d = plan.num_decodes
        log.plan(d, plan.num_tokens, sum(s.start_pos + 1 for s in plan.seqs[:d]))
        return plan

    def allocator() -> dict[str, int]:
        st = torch.cuda.memory_stats()
        return {k: st.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}

    launch = engine._launch
    ops, replay = engine.model.ops, torch.cuda.CUDAGraph.replay
    attention, upload, head = ops.paged_attention, runner.upload, engine.model.head

    def timed_launch(*args):
        parts.clear()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        launched = launch(*args)
        end.record()
        log.launched(time.perf_counter() - t, start, end, parts)
        return launched

    with StepLog(lag=int(engine.async_scheduling), counters=allocator) as log:
        sched.schedule, engine._launch = timed("schedule", logged), timed_launch
        runner.execute, sampler.launch = timed_execute, timed("sample", sample)
        # where a slow launch waits: in the eager attention between pieces, a graph's replay, the inputs' copy
        # to the device or the LM head
        ops.paged_attention = timed("attention_in_execute", attention)
        torch.cuda.CUDAGraph.replay = timed("replays_in_execute", replay)
        runner.upload, engine.model.head = timed("upload_in_execute", upload), timed("head_in_execute", head)
        try:
            secs, times = drain(engine, reqs, 60_000, log, early)
        finally:
            del sched.schedule, engine._launch, runner.execute, sampler.launch, runner.upload, engine.model.head
            ops.paged_attention, torch.cuda.CUDAGraph.replay = attention, replay
    ttft = sorted(t[0] for t in times.values())
    itl = sorted(b - a for t in times.values() for a, b in zip(t, t[1:]))
    pct = lambda xs, q: 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"output_tok_s": sum(len(t) for t in times.values()) / secs, "seconds": secs,
            "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
            "itl_ms_p50": pct(itl, 0.5), "itl_ms_p99": pct(itl, 0.99),
            "itl_over_60ms": sum(1 for x in itl if x > 0.06) / max(1, len(itl)),
            **{k: engine.stats()[k] - before[k] for k in ("prefix_hit_tokens", "preemptions")},
            "step_log": log.summary()}
