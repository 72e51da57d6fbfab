"""Steps with prompt chunks through piecewise graphs (workers/execute/piecewise_graphs.py): the layers' dense parts at
padded token buckets, attention eager between them. On the CPU the pieces run eagerly through the same code
(padding, static buffers, the scratch block); on the device they are captured and replayed."""
from __future__ import annotations

import random

import pytest
import torch

import mii_async

from ..helpers import head_dim_model, make_engine, run_engine, three_decoding


def test_token_buckets():
    from mii_async.workers.execute.piecewise_graphs import token_buckets

    assert token_buckets(16) == [16]
    assert token_buckets(40) == [16, 32, 48]
    b = token_buckets(1536)
    assert b[:9] == [16, 32, 48, 64, 80, 96, 112, 128, 160] and b[-1] == 1536 and b == sorted(set(b))
    assert all(x % 64 == 0 for x in b if x > 256)
    assert token_buckets(1500)[-1] == 1536        # the largest rounds up: a step of 1500 tokens fits


def _prompts(seed: int = 7, n: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 90))] for _ in range(n)]


def _attach_eager_pieces(engine, max_tokens: int):
    """The CPU engine with piecewise steps (pieces run eagerly): its KV pool grows by the scratch block that a
    GPU engine with graphs has, for the padded rows, filled with NaN (attention that read it would spread it)."""
    from mii_async.workers.execute.piecewise_graphs import PiecewiseGraphs

    kv = [tuple(torch.cat([c, c.new_full((1, *c.shape[1:]), float("nan"))]) for c in pair) for pair in engine.kv]
    engine.kv = engine.runner.kv_caches = kv
    pw = PiecewiseGraphs(engine.model, kv, engine.device, max_tokens,
                         scratch_slot=engine.num_blocks * engine.config.cache.block_size, capture=False)
    engine.runner.piecewise = pw
    return pw


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("async_", [False, True])
def test_padded_pieces_equal_the_plain_forward(tiny_model, kind, async_):
    """Chunked prompts beside decodes (step sizes 1 … 40, padded to buckets of 16, 32 and 48): the same greedy
    tokens as the plain forward, the same K/V in every block, and the padded rows' K/V only in the scratch
    block. With async scheduling, placeholder ids are filled before the ids reach the pieces."""
    prompts = _prompts()
    kw = dict(num_blocks=128, max_batch_tokens=40, async_scheduling=async_)
    plain = make_engine(tiny_model(kind), **kw)
    want = run_engine(plain, prompts, max_new_tokens=12, min_new_tokens=12)
    engine = make_engine(tiny_model(kind), **kw)
    pw = _attach_eager_pieces(engine, 48)
    assert run_engine(engine, prompts, max_new_tokens=12, min_new_tokens=12) == want
    assert pw.replays >= engine.num_steps - 1 > 20   # every step but, at most, a last decode of one row
    for (k0, v0), (k1, v1) in zip(plain.kv, engine.kv):
        torch.testing.assert_close(k1[:-1], k0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v1[:-1], v0, rtol=1e-4, atol=1e-5)
        assert not k1[-1].isnan().all() and not v1[-1].isnan().all()   # the padded rows wrote there


def test_tokens_handed_over_between_pieces_and_prompt_logprobs(tiny_model):
    """As a worker steps (async scheduling, `step(emit)`: the step in flight's tokens handed over between two
    layers of the next launch), with prompt logprobs scored in padded steps: the same tokens, the same prompt
    logprobs and ranks as the plain forward, and tokens handed over from between the pieces."""
    import numpy as np

    prompts = _prompts(11, 6)

    def run(engine):
        got: dict[int, list[int]] = {}
        plps = {}
        early = []

        def take(outs, during):
            for o in outs:
                got.setdefault(o.req_id, []).append(o.token_id)
                if o.prompt_logprobs is not None:
                    plps[o.req_id] = o.prompt_logprobs
            early.extend([during] * len(outs))

        for i, p in enumerate(prompts):
            engine.add_request(i, p, mii_async.SamplingParams(max_new_tokens=8, min_new_tokens=8,
                                                              prompt_logprobs=2 if i % 2 else None))
        while engine.has_work():
            take(engine.step(lambda outs: take(outs, True)), False)
        assert engine.block_manager.num_free == engine.num_blocks
        return got, plps, sum(early)

    kw = dict(num_blocks=128, max_batch_tokens=40, async_scheduling=True)
    want, want_lps, _ = run(make_engine(tiny_model("llama"), **kw))
    engine = make_engine(tiny_model("llama"), **kw)
    pw = _attach_eager_pieces(engine, 48)
    got, lps, handed_early = run(engine)
    assert got == want and pw.replays > 0 and handed_early > 0
    assert sorted(lps) == sorted(want_lps) == [1, 3, 5]
    for i, p in lps.items():
        w = want_lps[i]
        assert (p.n, p.top_ids, p.ranks) == (w.n, w.top_ids, w.ranks)
        for field in ("own", "top_logprobs"):
            np.testing.assert_allclose(np.frombuffer(getattr(p, field), "<f4"),
                                       np.frombuffer(getattr(w, field), "<f4"), atol=1e-5)


def test_logits_equal_and_large_steps_stay_eager(tiny_model):
    """One mixed plan's logits through the pieces equal the plain forward's; a step past the largest bucket
    runs the plain forward."""
    engine = make_engine(tiny_model("llama"), num_blocks=128, max_batch_tokens=200)
    pw = _attach_eager_pieces(engine, 64)
    rng = random.Random(1)
    engine.add_request(1, [rng.randrange(3, 320) for _ in range(20)],
                       mii_async.SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()                                    # prefill: 20 tokens, bucket 32
    assert pw.replays == 1
    engine.add_request(2, [rng.randrange(3, 320) for _ in range(37)], mii_async.SamplingParams(max_new_tokens=4))
    plan = engine.scheduler.schedule()               # a decode and a 37-token prompt: bucket 48
    assert plan.num_decodes == 1 and plan.num_tokens == 38
    pieces = engine.runner.execute(plan).clone()
    engine.runner.piecewise = None
    plain = engine.runner.execute(plan)
    torch.testing.assert_close(pieces, plain, rtol=1e-4, atol=1e-4)
    engine.runner.piecewise = pw
    engine.scheduler.commit_step()
    engine.add_request(3, [rng.randrange(3, 320) for _ in range(100)], mii_async.SamplingParams(max_new_tokens=2))
    before = pw.replays
    engine.step()                                    # 1 + 100 tokens > 64: the plain forward
    assert pw.replays == before


def test_the_memory_reserve_covers_the_static_buffers(tiny_model):
    """The memory plan's reserve for the pieces holds at least their static buffers, with room for a piece's
    working set at the largest bucket."""
    from mii_async.workers.execute.piecewise_graphs import piecewise_reserve

    engine = make_engine(tiny_model("qwen2"), num_blocks=16)
    pw = _attach_eager_pieces(engine, 100)                   # buckets up to 112
    static = sum(t.numel() * t.element_size() for t in (pw.io, pw.q, pw.attn, pw.h, pw.res))
    assert pw.max_tokens == 112 and static + (64 << 20) < piecewise_reserve(engine.model, 100)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["reference", "cuda"])
def test_captured_pieces_equal_eager_on_the_gpu(tmp_path, kernels):
    """On the device, with the pieces captured: the same greedy tokens as with no graphs at all, with and
    without async scheduling; the pieces replayed; no block leaked."""
    path = head_dim_model(tmp_path, 256, 4, 2, 4096, layers=3)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 40, 300, 1100, 17, 64, 9, 700)]
    outs = {}
    for piecewise, async_ in ((True, True), (True, False), (False, False)):
        engine = make_engine(path, device="cuda", dtype="float32", num_blocks=1024, kernels=kernels,
                             cuda_graphs=piecewise, piecewise_graphs=piecewise, max_num_seqs=8,
                             async_scheduling=async_, max_batch_tokens=512)
        assert (engine.runner.piecewise is not None) == piecewise
        outs[piecewise, async_] = run_engine(engine, prompts, max_new_tokens=16, min_new_tokens=16)
        if piecewise:
            assert engine.runner.piecewise.replays > 0
        assert engine.stats()["used_blocks"] == 0
    assert outs[True, True] == outs[True, False] == outs[False, False]


@pytest.mark.gpu
def test_captured_piece_logits_match_eager_in_bf16(tmp_path):
    """A mixed plan's logits from the captured pieces equal the eager forward's (bf16, the CuPy kernels)."""
    path = head_dim_model(tmp_path, 512, 4, 1, 2048)
    engine = make_engine(path, device="cuda", dtype="bfloat16", num_blocks=512, kernels="cuda", max_num_seqs=4,
                         step_token_multiple=1)        # the plan as asked, not cut to 320 tokens
    rng = random.Random(3)
    three_decoding(engine, rng)
    engine.add_request(9, [rng.randrange(3, 320) for _ in range(333)], mii_async.SamplingParams(max_new_tokens=2))
    plan = engine.scheduler.schedule()
    assert plan.num_decodes == 3 and plan.num_tokens == 336
    pw = engine.runner.piecewise
    replays = pw.replays
    pieces = engine.runner.execute(plan).clone()
    assert pw.replays == replays + 1
    engine.runner.piecewise = None
    eager = engine.runner.execute(plan)
    engine.runner.piecewise = pw
    assert torch.linalg.norm(pieces - eager) / torch.linalg.norm(eager) < 1e-2
