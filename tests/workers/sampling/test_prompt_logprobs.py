"""Prompt logprobs: each prompt token's logprob, its rank and the top n equal transformers' log-softmax of its own
prompt logits on the same weights, however the prompt is chunked, batched, preempted or cached, with async
scheduling or not; requests without them are unchanged, and no KV block leaks."""
from __future__ import annotations

import random

import pytest
import torch

from mii_async.params import SamplingParams
from mii_async.workers.core import scheduler as scheduler_mod

from ..helpers import make_engine

TOP = 3


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (1, 2, 17, 40, 75, 33, 9)]


def _hf_expected(path, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)   # [P, V]
            own = [None] + [lp[i, p[i + 1]].item() for i in range(len(p) - 1)]
            top = [None] + [torch.topk(lp[i], TOP) for i in range(len(p) - 1)]
            # the prompt token's rank, as a range: tokens within 3e-4 of it (three times the logprobs'
            # tolerance) may fall on either side of it
            rank = [None] + [(int((lp[i] > own[i + 1] + 3e-4).sum()) + 1, int((lp[i] >= own[i + 1] - 3e-4).sum()))
                             for i in range(len(p) - 1)]
            out.append((own, top, rank))
    return out


@pytest.fixture(scope="module")
def expected(tiny_model, prompts):
    return {kind: _hf_expected(tiny_model(kind), prompts) for kind in ("llama", "qwen2")}


def _run(engine, prompts, with_lp=None, **params):
    """Every prompt at once; returns each request's (outputs, prompt_logprobs: the engine's packed form, read
    as Logprobs)."""
    with_lp = set(range(len(prompts))) if with_lp is None else with_lp
    base = 50_000 + engine.num_steps * 100
    outs = {base + i: [] for i in range(len(prompts))}
    plps = {}
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=6, min_new_tokens=6, prompt_logprobs=TOP if i in with_lp else None,
                            **params)
        engine.add_request(base + i, p, sp)
    while engine.has_work():
        for o in engine.step():
            outs[o.req_id].append(o.token_id)
            if o.prompt_logprobs is not None:
                assert o.req_id not in plps and len(outs[o.req_id]) == 1, "prompt logprobs come once, first"
                assert o.prompt_logprobs.well_formed() and o.prompt_logprobs.n == TOP
                plps[o.req_id] = o.prompt_logprobs.to_logprobs(prompts[o.req_id - base])
        engine.block_manager.check_invariants(engine.seqs.values())
    assert engine.block_manager.num_free == engine.num_blocks, "KV blocks leaked"
    return [(outs[base + i], plps.get(base + i)) for i in range(len(prompts))]


def _check(got, want, prompt):
    own, top, rank = want
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        assert got[i].token_id == prompt[i] and got[i].logprob == pytest.approx(own[i], abs=1e-4), i
        assert rank[i][0] <= got[i].rank <= rank[i][1], (i, got[i].rank, rank[i])
        ids = [t for t, _ in got[i].top]
        assert ids == top[i].indices.tolist(), i
        assert [v for _, v in got[i].top] == pytest.approx(top[i].values.tolist(), abs=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("opts", [{"num_blocks": 256}, {"num_blocks": 256, "max_batch_tokens": 16},
                                  {"num_blocks": 256, "max_batch_tokens": 16, "async_scheduling": True},
                                  {"num_blocks": 22, "block_size": 8}])
def test_prompt_logprobs_match_transformers(tiny_model, prompts, expected, kind, opts):
    """Alone in one chunk, chunked 16 tokens a step beside decodes, with async scheduling, and preempted in a
    small pool: the same logprobs as transformers, and the same outputs as without them."""
    engine = make_engine(tiny_model(kind), **opts)
    got = _run(engine, prompts)
    for (_, plp), want, p in zip(got, expected[kind], prompts):
        _check(plp, want, p)
    plain = _run(engine, prompts, with_lp=set())
    assert [o for o, _ in got] == [o for o, _ in plain] and all(lp is None for _, lp in plain)
    if opts.get("block_size") == 8:
        assert engine.scheduler.num_preemptions > 0


def test_no_prefix_hits_and_the_scored_rows_cap(tiny_model, prompts, expected, monkeypatch):
    """A prompt asking for logprobs takes no prefix-cache hit (every position's logits are needed) while the
    same prompt without them does; with the per-step cap of scored rows at 8, no step scores more than 8 rows
    and the logprobs are unchanged."""
    monkeypatch.setattr(scheduler_mod, "MAX_SCORED_ROWS", 8)
    engine = make_engine(tiny_model("llama"), num_blocks=256, block_size=4)
    scored: list[int] = []
    schedule = engine.scheduler.schedule

    def spy():
        plan = schedule()
        scored.append(plan.num_scored)
        assert plan.num_scored == sum(s.score_to - s.score_from for s in plan.seqs)
        return plan

    engine.scheduler.schedule = spy
    _run(engine, prompts, with_lp=set())                        # the prompts are now cached
    hits = engine.block_manager.stats().hit_tokens
    got = _run(engine, prompts)
    assert engine.block_manager.stats().hit_tokens == hits
    for (_, plp), want, p in zip(got, expected["llama"], prompts):
        _check(plp, want, p)
    assert max(scored) == 8
    _run(engine, prompts, with_lp=set())
    assert engine.block_manager.stats().hit_tokens > hits


def test_an_abort_while_scoring_leaves_nothing(tiny_model):
    """A request aborted between its prompt chunks frees its blocks; the one beside it is unaffected."""
    engine = make_engine(tiny_model("llama"), num_blocks=64, max_batch_tokens=8)
    engine.add_request(1, list(range(3, 60)), SamplingParams(max_new_tokens=2, prompt_logprobs=0))
    engine.add_request(2, list(range(3, 20)), SamplingParams(max_new_tokens=2, prompt_logprobs=1))
    engine.step()
    assert engine.abort(1)
    firsts = [o for _ in range(40) if engine.has_work() for o in engine.step() if o.prompt_logprobs is not None]
    assert [o.req_id for o in firsts] == [2] and firsts[0].prompt_logprobs.num_positions == 16
    assert firsts[0].prompt_logprobs.n == 1 and len(firsts[0].prompt_logprobs.top_ids) == 4 * 16
    assert engine.block_manager.num_free == engine.num_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["reference", "cuda"])
def test_prompt_logprobs_on_cuda(tiny_model, prompts, expected, kernels):
    """fp32 on the GPU (async scheduling and decode graphs, the GPU defaults), chunked beside decodes: the same
    logprobs as transformers; the host copies are read behind the step's event."""
    engine = make_engine(tiny_model("llama"), device="cuda", dtype="float32", num_blocks=64, max_batch_tokens=16,
                         kernels=kernels)
    got = _run(engine, prompts)
    for (_, plp), want, p in zip(got, expected["llama"], prompts):
        _check(plp, want, p)


def test_the_cap_charges_only_positions_still_to_score():
    """A recompute after preemption scores nothing twice, so the positions scored before cost nothing of the
    step's cap; and a prefix-cache hit may cover them, not the positions still to score."""
    from mii_async.workers.core.block_manager import BlockManager
    from mii_async.workers.core.scheduler import _cap_scored
    from mii_async.workers.core.sequence import Sequence

    seq = Sequence(1, list(range(3, 43)), SamplingParams(max_new_tokens=1, prompt_logprobs=0))
    seq.num_scored = 20                                  # positions 0..19 scored before a preemption
    assert _cap_scored(seq, 40, 5) == (25, 5)            # 20 recomputed for free, then 5 scored
    assert _cap_scored(seq, 10, 0) == (10, 0)
    assert _cap_scored(seq, 40, 100) == (40, 19)         # up to the prompt's last but one
    bm = BlockManager(16, 8)
    donor = Sequence(2, list(range(3, 43)), SamplingParams(max_new_tokens=1))
    bm.append(donor, 40)
    donor.num_computed_tokens = 40
    bm.register_full_blocks(donor)
    bm.match_prefix(seq)
    assert seq.num_computed_tokens == 16                 # 2 blocks: 16 ≤ 20 scored positions
