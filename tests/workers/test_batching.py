"""Continuous batching: batch invariance, chunked prefill, preemption, prefix caching — same greedy outputs."""
from __future__ import annotations

import random

import pytest

from mii_async import protocol as P

from .helpers import make_engine, run_engine


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 120))] for _ in range(17)]


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    """Each prompt run alone, with a large budget."""
    engine = make_engine(tiny_model("llama"), num_blocks=128)
    return [run_engine(engine, [p], max_new_tokens=24, min_new_tokens=24)[0] for p in prompts]


def test_batch_invariance(tiny_model, prompts, reference):
    """A prompt's greedy output alone equals its output among 16 others of mixed lengths."""
    engine = make_engine(tiny_model("llama"), num_blocks=256)
    assert run_engine(engine, prompts, max_new_tokens=24, min_new_tokens=24) == reference


def test_chunked_prefill_tiny_budget(tiny_model, prompts, reference):
    """With a 16-token step budget, prompts are prefilled in chunks alongside decodes, same outputs."""
    engine = make_engine(tiny_model("llama"), num_blocks=256, max_batch_tokens=16)
    assert run_engine(engine, prompts, max_new_tokens=24, min_new_tokens=24) == reference
    assert engine.num_steps > 17 * 24 / 16


def test_small_pool_preempts_and_finishes(tiny_model, prompts, reference):
    """A KV pool too small for all requests at once: requests are preempted, all finish, same outputs."""
    engine = make_engine(tiny_model("llama"), num_blocks=24, block_size=8)   # 192 tokens for ~17 x 84
    assert run_engine(engine, prompts, max_new_tokens=24, min_new_tokens=24) == reference
    assert engine.scheduler.num_preemptions > 0


def test_mixed_budget_bounds_steps_with_decodes(tiny_model, prompts, reference):
    """max_mixed_batch_tokens=12 under a 96-token budget: a step that carries decodes holds at most
    max(12, its decodes) tokens, a step of prompts alone up to 96; same outputs."""
    engine = make_engine(tiny_model("llama"), num_blocks=256, max_batch_tokens=96, max_mixed_batch_tokens=12)
    assert engine.config.scheduler.max_mixed_batch_tokens == 12
    schedule, sizes = engine.scheduler.schedule, []

    def logged():
        waiting = {id(s) for s in engine.scheduler.running if s.num_tokens - s.num_computed_tokens == 1}
        plan = schedule()
        sizes.append((bool(waiting), plan.num_tokens, plan.num_decodes))
        return plan

    engine.scheduler.schedule = logged
    assert run_engine(engine, prompts, max_new_tokens=24, min_new_tokens=24) == reference
    assert all(n <= max(12, d) for dec, n, d in sizes if dec)
    assert max(n for dec, n, _ in sizes if not dec) > 12            # the first step: prompts alone, 96 tokens
    assert any(dec and n == 12 and d < 12 for dec, n, d in sizes)   # prompt chunks beside decodes, up to 12


def test_step_token_multiple_cuts_steps_and_keeps_outputs(tiny_model, prompts, reference):
    """step_token_multiple=8: steps with prompt chunks are cut to multiples of 8 where a chunk can give up the
    rest, which a later step computes; same greedy outputs, every block back at the end."""
    engine = make_engine(tiny_model("llama"), num_blocks=256, max_batch_tokens=40, step_token_multiple=8)
    schedule, sizes = engine.scheduler.schedule, []

    def logged():
        plan = schedule()
        sizes.append((plan.num_tokens, [(len(s.token_ids), s.sample) for s in plan.seqs]))
        return plan

    engine.scheduler.schedule = logged
    assert run_engine(engine, prompts, max_new_tokens=24, min_new_tokens=24) == reference
    # A cut: a step under the budget that stops a prompt chunk short of its end (uncut, it would take it all).
    # The rule for which step is cut where is test_block_manager.py's.
    assert any(n < 40 and any(c > 1 and not sample for c, sample in chunks) for n, chunks in sizes), sizes
    assert engine.block_manager.num_free == 256


def test_reset_prefix_cache_forgets_free_blocks(tiny_model, prompts, reference):
    """After reset_prefix_cache a repeated prompt is computed again (no hit), with the same output."""
    engine = make_engine(tiny_model("llama"), num_blocks=128, block_size=16)
    long = max(prompts, key=len)
    run_engine(engine, [long], max_new_tokens=24, min_new_tokens=24)
    assert set(P.ENGINE_COUNTERS) <= set(engine.stats())   # what the router's stats() sums
    cached = engine.stats()["cached_blocks"]
    assert cached == (len(long) + 23) // 16 > 0          # every full block of computed tokens
    assert engine.reset_prefix_cache() == cached and engine.stats()["cached_blocks"] == 0
    hits = engine.stats()["prefix_hit_tokens"]
    assert run_engine(engine, [long], max_new_tokens=24, min_new_tokens=24) == [reference[prompts.index(long)]]
    assert engine.stats()["prefix_hit_tokens"] == hits


def test_prefix_cache_hits(tiny_model, prompts, reference):
    """A repeated prompt takes its full blocks from the prefix cache (counted) and gives the same output."""
    engine = make_engine(tiny_model("llama"), num_blocks=128, block_size=16)
    long = max(prompts, key=len)
    first = run_engine(engine, [long], max_new_tokens=24, min_new_tokens=24)
    hits = engine.stats()["prefix_hit_tokens"]
    second = run_engine(engine, [long], max_new_tokens=24, min_new_tokens=24)
    assert first == second == [reference[prompts.index(long)]]
    assert engine.stats()["prefix_hit_tokens"] - hits == (len(long) - 1) // 16 * 16


def test_prefix_cache_shared_prefix_concurrently(tiny_model):
    """Requests sharing a long system prefix reuse its blocks and match their uncached outputs."""
    rng = random.Random(3)
    system = [rng.randrange(3, 320) for _ in range(64)]
    batch = [system + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 20))] for _ in range(6)]
    cold = make_engine(tiny_model("llama"), num_blocks=128, enable_prefix_caching=False)
    expected = [run_engine(cold, [p], max_new_tokens=16, min_new_tokens=16)[0] for p in batch]
    warm = make_engine(tiny_model("llama"), num_blocks=128)
    run_engine(warm, [batch[0]], max_new_tokens=1)
    assert run_engine(warm, batch, max_new_tokens=16, min_new_tokens=16) == expected
    assert warm.stats()["prefix_hit_tokens"] >= 6 * 64


def test_prefix_counters_count_each_admission_once(tiny_model):
    """A queue head that waits for blocks is matched again each step but counted once, when admitted; a
    request's cached_tokens (its usage) are its first admission's, whatever its recompute after a preemption
    finds (here two unrelated prompts in a pool too small for both: nothing was ever served from the cache)."""
    from mii_async.params import SamplingParams

    rng = random.Random(4)
    engine = make_engine(tiny_model("llama"), block_size=4, num_blocks=12, max_batch_tokens=64)
    prompts = [[rng.randrange(3, 320) for _ in range(10)] for _ in range(2)]
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_new_tokens=30, ignore_eos=True))
    cached = {0: set(), 1: set()}
    while engine.has_work():
        for o in engine.step():
            cached[o.req_id].add(o.cached_tokens)
    st = engine.stats()
    assert st["preemptions"] >= 1 and cached == {0: {0}, 1: {0}}
    # each admission looks up its prompt once: two first admissions plus one per recompute
    assert st["prefix_query_tokens"] == 10 * (2 + st["preemptions"])
    assert st["prefix_hit_tokens"] <= 8 * st["preemptions"]        # a recompute finds its own full blocks
