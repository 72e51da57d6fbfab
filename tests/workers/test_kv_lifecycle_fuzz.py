"""KV blocks and request lifecycles through a real Engine (a tiny random Llama, CPU, float32), driven by random
sequences of add / abort / step on small pools: after every step the block accounting is exact (refs = holders,
free ⇔ unreferenced, no live sequence on a freed block, prefix digests match the tokens they cover), every
request ends, every block is free at idle, and finished greedy or seeded requests give the tokens they give alone."""
from __future__ import annotations

import random
from concurrent.futures import Future

import pytest
import torch

from mii_async.params import SamplingParams
from mii_async.workers.core.block_manager import block_digest
from mii_async.workers.sampling.guide_compiler import CompileError
from mii_async.workers.sampling.guides import GuidedRequests
from mii_async.workers.core.sequence import Status

from .helpers import make_engine


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for these tiny matrices: on a loaded 2-core machine two threads that wait on each
    other made a step ~100 times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model):
    """(prompt, params) → the request's tokens run alone, synchronously, with a large pool and no prefix cache."""
    engine = guided(make_engine(model, num_blocks=256, enable_prefix_caching=False, async_scheduling=False),
                    FakeCompiler(at_once=True))
    done: dict[tuple, list[int]] = {}

    def get(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params)
        if key not in done:
            rid = len(done)
            engine.add_request(rid, prompt, params)
            out = []
            while engine.has_work():
                out += [o.token_id for o in engine.step() if o.req_id == rid]
            done[key] = out
        return done[key]

    return get


class FakeCompiler:
    """The guide compiler's interface on an automaton of a made-up vocabulary (ids 3 … 28 as a … z), compiled
    when the test says (`settle`), or at once; a guide's regex text is not read."""

    def __init__(self, at_once: bool = False) -> None:
        from outlines_core import Index, Vocabulary

        self.index_ = Index("[a-c]{2,6}", Vocabulary(2, {chr(97 + i): [3 + i] for i in range(26)}))
        self.at_once = at_once
        self.futures: list[Future] = []

    def index(self, guide) -> Future:
        fut: Future = Future()
        if self.at_once:
            fut.set_result((self.index_, 7_000_001))
        self.futures.append(fut)
        return fut

    def settle(self, rng: random.Random) -> None:
        """Finishes some of the compiles: most with the automaton, a few with a lasting failure."""
        for fut in self.futures:
            if not fut.done() and rng.random() < 0.5:
                if rng.random() < 0.8:
                    fut.set_result((self.index_, 7_000_001))
                else:
                    fut.set_exception(CompileError("refused", lasting=True))

    def release(self, fut: Future) -> None:
        pass

    def close(self) -> None:
        pass


def guided(engine, compiler: FakeCompiler):
    engine.guided = GuidedRequests(compiler)     # type: ignore[arg-type]
    return engine


def check_kv(engine) -> None:
    """The engine's block accounting, between two steps."""
    bm, sched = engine.block_manager, engine.scheduler
    held = [s for s in engine.seqs.values() if engine.guided is None or s.req_id not in engine.guided.pending]
    bm.check_invariants(held)                      # refs = holders, free ⇔ unreferenced, hash tables agree
    assert sorted(map(id, sched.all_seqs())) == sorted(map(id, held)), "the scheduler and the engine disagree"
    assert len(sched.running) <= engine.config.scheduler.max_num_seqs
    bs = bm.block_size
    for s in sched.running:
        assert s.status is Status.RUNNING
        assert len(s.block_table) == -(-s.num_computed_tokens // bs), f"seq {s.req_id}: table and tokens differ"
    for s in sched.waiting:
        assert s.status is Status.WAITING and not s.block_table and s.num_computed_tokens == 0
    for s in held:                                 # a registered prefix is the digest of the tokens it covers
        parent = None
        for i in range(s.num_hashed_blocks):
            tokens = s.token_ids(i * bs, (i + 1) * bs)
            assert min(tokens) >= 0, f"seq {s.req_id}: a placeholder id was hashed"
            parent = block_digest(parent, tokens)
            if bm._hash_of.get(s.block_table[i], parent) != parent:
                raise AssertionError(f"seq {s.req_id}: block {i} is cached under another prefix")
        assert s.last_block_hash == parent


def check_idle(engine) -> None:
    bm = engine.block_manager
    assert not engine.has_work() and not engine.seqs and engine.flush() == []
    assert bm.num_free == bm.num_blocks, f"{bm.num_blocks - bm.num_free} KV blocks leaked"
    assert not engine.sampler._generators, "a finished request's generator was kept"


def random_params(rng: random.Random, room: int) -> SamplingParams:
    p: dict = {"max_new_tokens": max(1, min(room, rng.randint(1, 16) if rng.random() > 0.1 else room))}
    if rng.random() < 0.3:
        p["stop_token_ids"] = tuple(rng.sample(range(3, 320), 40))
    if rng.random() < 0.3:
        p["min_new_tokens"] = rng.randint(0, p["max_new_tokens"])
    if rng.random() < 0.5:
        p["ignore_eos"] = True
    if rng.random() < 0.15:
        p["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.15:
        p["logprobs"] = 2
    if rng.random() < 0.15:
        p.update(temperature=0.9, seed=rng.randrange(100))
    if rng.random() < 0.1:
        p["repetition_penalty"] = 1.3
    if rng.random() < 0.2:
        p["guided_regex"] = "[a-c]{2,6}"           # (FakeCompiler's automaton)
    return SamplingParams(**p)


def drive(engine, rng: random.Random, reference, ops: int, first_id: int) -> None:
    """A random workload: requests (shared prefixes, identical prompts, ones that fill the context or the pool),
    aborts between steps and from `emit` (a step in flight), steps; then every request is run to its end."""
    cap = engine.max_request_tokens
    prefixes = [[rng.randrange(3, 320) for _ in range(rng.randint(1, 40))] for _ in range(3)]
    outs: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    asked: dict[int, tuple[list[int], SamplingParams]] = {}
    aborted: set[int] = set()
    compiler = engine.guided.compiler

    def record(o) -> None:
        assert o.req_id not in reasons, f"request {o.req_id}: a token after its end"
        assert (o.prompt_logprobs is not None) == (not outs[o.req_id] and asked[o.req_id][1].prompt_logprobs
                                                   is not None)
        outs[o.req_id].append(o.token_id)
        if o.finish_reason:
            reasons[o.req_id] = o.finish_reason

    def abort_one() -> None:
        rid = rng.choice(list(engine.seqs))
        assert engine.abort(rid)
        aborted.add(rid)

    def emit(outputs) -> None:
        for o in outputs:
            record(o)
        if engine.seqs and rng.random() < 0.3:
            abort_one()

    for _ in range(ops):
        r = rng.random()
        if r < 0.3:
            kind = rng.random()
            if kind < 0.4:
                prompt = rng.choice(prefixes) + [rng.randrange(3, 320) for _ in range(rng.randint(0, 20))]
            elif kind < 0.55 and asked:
                prompt = list(rng.choice(list(asked.values()))[0])       # n > 1: an identical prompt
            else:
                prompt = [rng.randrange(3, 320) for _ in range(rng.randint(1, 60))]
            prompt = prompt[:cap - 2]
            rid = first_id + len(asked)
            asked[rid] = (prompt, random_params(rng, cap - len(prompt)))
            outs[rid] = []
            engine.add_request(rid, *asked[rid])
        elif r < 0.38 and engine.seqs:
            abort_one()
        elif r < 0.45:
            compiler.settle(rng)
        else:
            for o in engine.step(emit if engine.async_scheduling and rng.random() < 0.5 else None):
                record(o)
        check_kv(engine)
    for _ in range(10_000):
        if not engine.has_work():
            break
        compiler.settle(rng)
        for o in engine.step():
            record(o)
        check_kv(engine)
    check_idle(engine)
    failed = {rid for rid, _, param in engine.take_failed() if param == "guided_regex"}
    for rid, (prompt, params) in asked.items():
        if rid in failed:
            assert not outs[rid] and params.guide is not None
        elif rid not in aborted:
            assert rid in reasons, f"request {rid} never ended"
            assert outs[rid] == reference(prompt, params), f"request {rid}: other tokens than alone"


CONFIGS = {
    "sync-cached": dict(num_blocks=12, block_size=4, max_batch_tokens=33, max_num_seqs=8),
    "async-cached": dict(num_blocks=12, block_size=4, max_batch_tokens=16, async_scheduling=True),
    "async-uncached-bs1": dict(num_blocks=40, block_size=1, max_batch_tokens=64, async_scheduling=True,
                               enable_prefix_caching=False, max_num_seqs=3),
    "async-multiple-mixed": dict(num_blocks=20, block_size=2, max_batch_tokens=64, max_mixed_batch_tokens=20,
                                 step_token_multiple=8, async_scheduling=True),
    "sync-context-limit": dict(num_blocks=8, block_size=8, max_batch_tokens=512, max_model_len=48,
                               step_token_multiple=4),
    "async-one-seq": dict(num_blocks=8, block_size=8, max_batch_tokens=8, max_num_seqs=1, async_scheduling=True),
    # admission's watermark (1% of a real pool) at a share of this small one that it shapes every admission
    "async-watermark": dict(num_blocks=16, block_size=4, max_batch_tokens=32, async_scheduling=True,
                            watermark_blocks=3),
    "sync-watermark-uncached": dict(num_blocks=16, block_size=2, max_batch_tokens=24, enable_prefix_caching=False,
                                    watermark_blocks=2),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_workloads_keep_kv_accounting_exact(model, reference, name):
    """Random add / abort / step on a small pool: exact accounting after every step, nothing leaked at idle,
    the tokens of every finished request as alone (preemption, prefix hits, async placeholders, guides that
    compile late or fail included)."""
    config = dict(CONFIGS[name])
    watermark = config.pop("watermark_blocks", None)
    engine = guided(make_engine(model, **config), FakeCompiler())
    if watermark is not None:
        engine.scheduler.watermark_blocks = watermark
    for seed in range(5):
        drive(engine, random.Random(f"{name}/{seed}"), reference, ops=120, first_id=seed * 1000)
    assert engine.scheduler.num_preemptions > 0 or name == "async-one-seq"


def _planned(engine) -> list[list[tuple[int, int, int]]]:
    """Records each plan as (req_id, start, tokens) rows."""
    log: list[list[tuple[int, int, int]]] = []
    schedule = engine.scheduler.schedule

    def logged():
        plan = schedule()
        log.append([(s.req_id, s.start_pos, len(s.token_ids)) for s in plan.seqs])
        return plan

    engine.scheduler.schedule = logged
    return log


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_newest_prefill_that_does_not_fit_waits_instead_of_recomputing(model, reference, async_scheduling):
    """A prompt chunk of the newest running request that finds no free block (an older request holds the rest of
    the pool) waits, keeping what it computed, instead of preempting itself: requeued at the front, it was
    readmitted at once on what was free and prefilled again from position 0, step after step."""
    engine = make_engine(model, num_blocks=6, block_size=4, max_batch_tokens=8, enable_prefix_caching=False,
                         async_scheduling=async_scheduling)
    older = ([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=4, ignore_eos=True))       # 2 blocks, never more
    newer = (list(range(20, 38)), SamplingParams(max_new_tokens=2, ignore_eos=True))   # 18 tokens: 5 blocks
    engine.add_request(0, *older)
    outs: dict[int, list[int]] = {0: [o.token_id for o in engine.step()], 1: []}
    engine.add_request(1, *newer)
    log = _planned(engine)
    while engine.has_work():
        for o in engine.step():
            outs[o.req_id].append(o.token_id)
        check_kv(engine)
    check_idle(engine)
    assert outs == {0: reference(*older), 1: reference(*newer)}
    starts = [start for plan in log for rid, start, _ in plan if rid == 1]
    assert starts == sorted(starts) and starts.count(0) == 1, f"the prompt was prefilled again: {starts}"
    assert engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_at_any_step_frees_its_blocks_and_leaves_the_others_alone(model, reference, async_scheduling):
    """Each request of a small workload (a chunked prompt, one sharing its prefix and scoring prompt logprobs,
    a short one with stop ids) aborted before each step in turn (with async scheduling, every other one from
    `emit` while the next step is launched): exact accounting after every step, no block left at idle, the
    others' tokens as alone."""
    engine = make_engine(model, num_blocks=8, block_size=4, max_batch_tokens=12, async_scheduling=async_scheduling)
    rng = random.Random(3)
    shared = [rng.randrange(3, 320) for _ in range(8)]
    work = [(shared + [rng.randrange(3, 320) for _ in range(14)], SamplingParams(max_new_tokens=4, ignore_eos=True)),
            (shared + [rng.randrange(3, 320) for _ in range(4)],
             SamplingParams(max_new_tokens=3, prompt_logprobs=1, ignore_eos=True)),
            ([rng.randrange(3, 320) for _ in range(6)], SamplingParams(max_new_tokens=6, stop_token_ids=(7, 9)))]
    expected = [reference(*w) for w in work]
    for i, w in enumerate(work):
        engine.add_request(i, *w)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    base = 0
    for target in range(len(work)):
        for at in range(steps):
            from_emit = async_scheduling and (target + at) % 2 == 1
            base += 10
            outs: dict[int, list[int]] = {base + i: [] for i in range(len(work))}
            for i, w in enumerate(work):
                engine.add_request(base + i, *w)

            def emit(outputs, rid=base + target):
                for o in outputs:
                    outs[o.req_id].append(o.token_id)
                engine.abort(rid)

            for step in range(200):
                if not engine.has_work():
                    break
                if step == at and not from_emit:
                    engine.abort(base + target)
                for o in engine.step(emit if step == at and from_emit else None):
                    outs[o.req_id].append(o.token_id)
                check_kv(engine)
            check_idle(engine)
            for i, e in enumerate(expected):
                got = outs[base + i]
                assert got == (e if i != target else e[:len(got)]), (target, at, from_emit, i)
    assert engine.scheduler.num_preemptions > 0
