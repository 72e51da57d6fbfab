"""Where a step's time goes, for the Llama-3-8B-shape benchmark (`python -m benchmarks.llama8b --only
profile`): GPU time by kernel category for eager steps (decode-only, and mixed steps of decodes plus prompt
chunks), and for decode steps replayed from CUDA graphs, with the host parts of a step timed one by one."""
from __future__ import annotations

import time

import torch

import mii_async

from .token_prompts import prompts

# First match wins: attention first, since flash's kernel names carry cutlass types.
CATEGORIES = (("attention", ("paged_attention", "flash", "fmha", "attention")),
              ("gemm", ("gemm", "cutlass", "xmma", "sm90", "cublas", "nvjet", "gemv")),
              ("norms", ("rms_norm",)), ("rotary+kv", ("rotary",)), ("silu", ("silu",)),
              ("sampling", ("argmax", "softmax", "sort", "topk", "exponential", "cumsum")))


def _running(engine, batch: int, base: int, prompt_len: int = 128) -> None:
    """`batch` requests of `prompt_len`-token prompts, stepped until every one has sampled twice: all `batch`
    decode from then on (their outputs are long enough that none ends while profiled; `_clear` ends them)."""
    for i, p in enumerate(prompts(batch, prompt_len, prompt_len, 7)):
        engine.add_request(base + i, p, mii_async.SamplingParams(max_new_tokens=1024, ignore_eos=True))
    while any(len(s.output_ids) - s.num_pending < 2 for s in engine.seqs.values()):
        engine.step()
    engine.flush()


def _clear(engine) -> None:
    engine.flush()
    for s in list(engine.seqs.values()):
        engine.abort(s.req_id)


def _categories(prof, steps: int) -> dict[str, float]:
    cats: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if not us or ev.key.startswith(("cudaLaunch", "ProfilerStep", "cudaGraphLaunch")):
            continue
        name = ev.key.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")
        cats[cat] = cats.get(cat, 0.0) + us / 1e3 / steps
    return cats


def _top_kernels(prof, steps: int, n: int = 8) -> list[tuple[str, float]]:
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us and not ev.key.startswith(("cudaLaunch", "ProfilerStep", "cudaGraphLaunch")):
            rows.append((ev.key[:80], round(us / 1e3 / steps, 3)))
    return sorted(rows, key=lambda r: -r[1])[:n]


def profile(engine, batch: int, steps: int = 8, prompt_len: int = 0, context: int = 128,
            steady: bool = False) -> dict:
    """GPU time per step by category (eager, so that each kernel shows) and the step's wall time; the batch
    decodes after `context`-token prompts. With `prompt_len`, new prompts of that length arrive once the batch
    decodes, so that the profiled steps are mixed: 16 of them at once fill the token budget, or, `steady`, one
    before each step (each asks one token, so it ends with its prefill): the mixed load's steady state, where a
    full batch admits a prompt as a sequence ends."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    graphs, engine.runner.graphs = engine.runner.graphs, None
    pieces, engine.runner.piecewise = engine.runner.piecewise, None      # eager: every kernel launched on its own
    _running(engine, batch, 70_000, context)
    arriving = prompts(steps if steady else 16, prompt_len, prompt_len, 8) if prompt_len else []
    arrive = lambda i, p, n: engine.add_request(  # noqa: E731
        71_000 + i, p, mii_async.SamplingParams(max_new_tokens=n, ignore_eos=True))
    if not steady:
        for i, p in enumerate(arriving):
            arrive(i, p, 2)
    torch.cuda.synchronize()
    tokens = 0
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            if steady and arriving:
                arrive(i, arriving[i], 1)
            seqs = dict(engine.seqs)             # kept: a sequence that ends in this step leaves engine.seqs
            before = {r: s.num_computed_tokens for r, s in seqs.items()}
            engine.step()
            seqs.update(engine.seqs)
            tokens += sum(s.num_computed_tokens - before.get(r, 0) for r, s in seqs.items())
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    _clear(engine)
    engine.runner.graphs, engine.runner.piecewise = graphs, pieces
    cats = _categories(prof, steps)
    gpu = sum(cats.values())
    return {"batch": batch, "context": context, "prompt_len": prompt_len, "steady": steady,
            "tokens_per_step": tokens / steps, "wall_ms_per_step": 1e3 * wall, "gpu_ms_per_step": gpu,
            "host_or_idle_ms_per_step": 1e3 * wall - gpu, **{f"{k}_ms": v for k, v in sorted(cats.items())},
            "top_kernels": _top_kernels(prof, steps)}


def graph_steps(engine, batch: int, steps: int = 16, prompt_len: int = 128) -> dict:
    """Decode steps replayed from graphs: wall per step, the graph's own GPU time (replays alone, CUDA events)
    and its kernels by category, and the host parts of a step timed one by one (with a sync before sampling,
    so that it waits on nothing). The contexts start at `prompt_len`; the replays are of the graph of the
    context cap that holds them."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    g = engine.runner.graphs
    if g is None:
        return {}
    _running(engine, batch, 80_000, prompt_len)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    engine.flush()
    parts = {"schedule": 0.0, "launch": 0.0, "gpu_wait": 0.0, "sample": 0.0, "commit_and_outputs": 0.0}
    sched, runner = engine.scheduler, engine.runner
    for _ in range(steps):                       # Engine.step, split (no TP here)
        t = [time.perf_counter()]
        plan = sched.schedule()
        t.append(time.perf_counter())
        logits = runner.execute(plan)
        t.append(time.perf_counter())
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        sampled = sched.commit_step()
        result = engine.sampler(logits, sampled)
        t.append(time.perf_counter())
        for seq, tok in zip(sampled, result.token_ids):
            seq.output_ids.append(tok)
        t.append(time.perf_counter())
        for k, a, b in zip(parts, t, t[1:]):
            parts[k] += 1e3 * (b - a) / steps
    cap = next(c for c in g.caps if c.cap >= prompt_len + 3 * steps + 2 and c.max_batch >= batch)
    b = next(x for x in cap.buckets if x >= batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        cap.graphs[b].replay()
    end.record()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            cap.graphs[b].replay()
        torch.cuda.synchronize()
    _clear(engine)
    replay = start.elapsed_time(end) / steps
    cats = _categories(prof, 4)
    return {"batch": batch, "prompt_len": prompt_len, "context_cap": cap.cap, "wall_ms_per_step": 1e3 * wall, "graph_gpu_ms": replay,
            "host_exposed_ms": 1e3 * wall - replay, "async_scheduling": engine.async_scheduling,
            **{f"{k}_ms": v for k, v in parts.items()},
            "graph_kernels": {f"{k}_ms": v for k, v in sorted(cats.items())}, "graph_top_kernels": _top_kernels(prof, 4)}
