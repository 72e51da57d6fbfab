"""CPU decode attention, old against new (`python -m benchmarks.cpu_decode_attention`): the padded gather with
masked SDPA (reference._padded_decode_attention, which the reference keeps for the GPU) against reading each
row's runs in place (kernels/cpu_decode_attention.py), on the default model's shapes (9 query heads over 3 KV
heads of 64, blocks of 16).

  op:     one layer's call, per batch and context, in two block-table layouts: `runs` (each row's blocks
          consecutive, as a lone sequence gets them) and `decoded` (a prompt's run of up to 128 tokens, then one
          block at a time interleaved with the other rows', at least one, as concurrent decodes take them: short
          rows attend as the plan's gathered group, longer ones in runs and a copy). The new call's per-step plan
          is timed apart: every layer of a step shares it.
  engine: ms per decode step of the default model (fp32 on the CPU) at each batch, 128-token prompts
          (--prompt), the engine's op set switched between the two at every step.

Old and new are interleaved in one process and repeated; each figure is a median. The machine may be shared:
compare the two columns of one run, not figures of different runs.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

import torch

HQ, HKV, D, BS = 9, 3, 64, 16
PROMPT = 128
KV_BYTES_PER_TOKEN = 2 * 30 * HKV * D * 4     # the default model's fp32 K and V in its 30 layers
EVICT_BYTES = 640 << 20     # read between timed op calls: more than the weights (517 MB) a decode step streams


def _cold_ms(fn: Callable[[], object], reps: int, evict: torch.Tensor) -> list[float]:
    """`fn`'s times in ms, each call after `evict` is read through: in a decode step the layer's K/V come from
    memory, the weights of every other layer having passed through the caches since the layer last ran."""
    fn()
    times = []
    for _ in range(reps):
        evict.sum()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def _tables(layout: str, batch: int, context: int) -> list[list[int]]:
    nb = -(-context // BS)
    if layout == "runs":
        return [list(range(s * nb, (s + 1) * nb)) for s in range(batch)]
    prompt = min(nb - 1, PROMPT // BS)
    tables = [list(range(s * prompt, (s + 1) * prompt)) for s in range(batch)]
    at = batch * prompt
    for _ in range(prompt, nb):
        for t in tables:
            t.append(at)
            at += 1
    return tables


def op_rows(batches: list[int], contexts: list[int], threads: list[int], repeats: int) -> None:
    from mii_async.kernels import cpu_decode_attention as cda
    from mii_async.kernels import reference
    from mii_async.kernels.metadata import AttentionMetadata

    print("op: one layer's decode attention, ms per call (median), its K/V read from memory, not the caches; "
          "plan: once per step, ms")
    print(f"{'threads':>7} {'batch':>5} {'context':>7} {'layout':>8} {'old':>9} {'new':>9} {'speedup':>7} "
          f"{'plan':>7} {'rel err':>8}")
    rng = random.Random(0)
    evict = torch.ones(EVICT_BYTES // 4)
    for t in threads:
        torch.set_num_threads(t)
        for b in batches:
            for c in contexts:
                for layout in ("runs", "decoded"):
                    tables = _tables(layout, b, c)
                    n = max(max(x) for x in tables) + 1
                    kc, vc = torch.randn(n, BS, HKV, D), torch.randn(n, BS, HKV, D)
                    q = torch.randn(b, HQ, D)
                    clens = [c - (rng.randrange(BS) if s else 0) for s in range(b)]
                    meta = AttentionMetadata(torch.zeros(b, dtype=torch.int64), torch.tensor(tables),
                                             torch.tensor(clens), torch.arange(b + 1), b, c, [1] * b, clens)
                    old_out, new_out = torch.empty_like(q), torch.empty_like(q)
                    plan = cda.plan_decodes(meta.block_tables, clens, BS, None)

                    def old() -> None:
                        reference._padded_decode_attention(q, kc, vc, meta, D ** -0.5, old_out, None, None)

                    def new() -> None:
                        cda.decode_attention(q, kc, vc, plan, D ** -0.5, new_out)

                    olds: list[float] = []
                    news: list[float] = []
                    for _ in range(repeats):                # interleaved A/B
                        olds += _cold_ms(old, 5, evict)
                        news += _cold_ms(new, 5, evict)
                    plan_ms = statistics.median(
                        _cold_ms(lambda: cda.plan_decodes(meta.block_tables, clens, BS, None), 5, evict[:1]))
                    err = ((new_out - old_out).abs().max() / old_out.abs().max()).item()
                    o, nw = statistics.median(olds), statistics.median(news)   # cold calls: medians
                    print(f"{t:>7} {b:>5} {c:>7} {layout:>8} {o:>9.3f} {nw:>9.3f} {o / nw:>6.2f}x {plan_ms:>7.3f} "
                          f"{err:>8.1e}", flush=True)


def _old_paged_attention(q, k_cache, v_cache, meta, scale, out=None, window=None, softcap=None):
    """paged_attention with its decodes through the padded gather on the CPU too."""
    from mii_async.kernels import reference

    out = torch.empty_like(q) if out is None else out
    if meta.num_decodes:
        reference._padded_decode_attention(q, k_cache, v_cache, meta, scale, out, window, softcap)
    reference.prefill_attention(q, k_cache, v_cache, meta, scale, out, window, softcap)
    return out


def _decode_steps(engine, batch: int, prompt: int, steps: int, base: int,
                  first_old: bool) -> tuple[list[float], list[float]]:
    """`batch` rows decoding after `prompt`-token prompts (prefill steps not timed), then 2 × `steps` decode steps
    timed with the op set's paged_attention switched between old and new at every step: both see the same batch
    and contexts, and the machine's load alike. Returns (old ms, new ms) per step."""
    import mii_async

    ops = engine.model.ops
    rng = random.Random(base)
    for i in range(batch):
        engine.add_request(base + i, [rng.randrange(100, 40000) for _ in range(prompt)],
                           mii_async.SamplingParams(max_new_tokens=2 * steps + 4, ignore_eos=True))
    while any(len(s.output_ids) - s.num_pending < 2 for s in engine.seqs.values()):
        engine.step()
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(2 * steps):
        old = (i % 2 == 0) == first_old
        if old:
            ops.paged_attention = _old_paged_attention      # shadows the op set's own op (op_set.py)
        elif "paged_attention" in vars(ops):
            del ops.paged_attention
        t = time.perf_counter()
        engine.step()
        times[0 if old else 1].append((time.perf_counter() - t) * 1e3)
    if "paged_attention" in vars(ops):
        del ops.paged_attention
    while engine.has_work():
        engine.step()
    return times


def _p10(times: list[float]) -> float:
    """The 10th percentile: on a shared machine, what a step costs when nothing else runs beside it."""
    return sorted(times)[len(times) // 10]


def engine_rows(batches: list[int], threads: list[int], repeats: int, steps: int, prompt: int) -> None:
    from mii_async.config import EngineConfig, default_cache_dir
    from mii_async.model_source import resolve_model
    from mii_async.workers.engine import Engine

    path = resolve_model(None, default_cache_dir())
    kv_gib = max(1.0, 1.25 * max(batches) * (prompt + 2 * steps + 4) * KV_BYTES_PER_TOKEN / 2**30)
    engine = Engine(EngineConfig.from_kwargs(str(path), device="cpu", dtype="float32", kv_cache_memory=kv_gib))
    print(f"engine: {path.name}, fp32, {prompt}-token prompts, ms per decode step (median and 10th percentile "
          f"over {repeats} rounds of {2 * steps} steps, old and new alternating step by step)")
    print(f"{'threads':>7} {'batch':>5} {'old':>9} {'new':>9} {'speedup':>7} {'old p10':>9} {'new p10':>9} "
          f"{'speedup':>7}")
    base = 0
    for t in threads:
        torch.set_num_threads(t)
        for b in batches:
            olds: list[float] = []
            news: list[float] = []
            for r in range(repeats):
                base += 1000
                o, n = _decode_steps(engine, b, prompt, steps, base, first_old=r % 2 == 0)
                olds += o
                news += n
            o, n = statistics.median(olds), statistics.median(news)
            o10, n10 = _p10(olds), _p10(news)
            print(f"{t:>7} {b:>5} {o:>9.1f} {n:>9.1f} {o / n:>6.2f}x {o10:>9.1f} {n10:>9.1f} {o10 / n10:>6.2f}x",
                  flush=True)
    engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="128,512,2048", help="op: keys per row")
    ap.add_argument("--threads", default="1,2", help="torch intra-op threads, each in turn")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved old/new rounds")
    ap.add_argument("--steps", type=int, default=8, help="engine: decode steps timed per round for each of the two")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="engine: prompt tokens per row")
    ap.add_argument("--only", choices=("op", "engine"), default=None)
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]              # noqa: E731
    with torch.inference_mode():
        if args.only in (None, "op"):
            op_rows(ints(args.batches), ints(args.contexts), ints(args.threads), args.repeats)
        if args.only in (None, "engine"):
            engine_rows(ints(args.batches), ints(args.threads), args.repeats, args.steps, args.prompt)


if __name__ == "__main__":
    main()
