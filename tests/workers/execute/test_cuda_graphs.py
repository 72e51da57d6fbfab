"""Decode steps replayed from CUDA graphs, and the GPU memory plan (on the device; skipped without CUDA)."""
from __future__ import annotations

import random

import pytest
import torch

import mii_async

from ..helpers import head_dim_model as _model, make_engine, run_engine, three_decoding

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kernels", ["reference", "cuda"])
def test_graph_decode_equals_eager(tmp_path, kernels):
    """Batches that need padding (3, 5, 7 sequences), and contexts past the first cap (2048): the same greedy
    tokens with graphs as eagerly, with and without async scheduling (placeholder ids filled on the device
    before a replay), replays counted, and no KV block written by a padded row."""
    path = _model(tmp_path, 256, 4, 2, 4096)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 40, 300, 2100, 17, 64, 9)]
    outs = {}
    for graphs, async_ in ((True, True), (True, False), (False, False)):
        engine = make_engine(path, device="cuda", dtype="float32", num_blocks=2048, kernels=kernels,
                             cuda_graphs=graphs, max_num_seqs=8, async_scheduling=async_)
        assert (engine.runner.graphs is not None) == graphs
        outs[graphs, async_] = run_engine(engine, prompts, max_new_tokens=20, min_new_tokens=20)
        if graphs:
            g = engine.runner.graphs
            assert g.replays > 0 and [c.cap for c in g.caps] == [512, 2048, 4096]
            assert engine.stats()["used_blocks"] == 0
    assert outs[True, True] == outs[True, False] == outs[False, False]


def test_a_long_document_decodes_from_a_long_cap_graph(tmp_path):
    """Contexts past 8192 tokens at a small batch replay the graphs of a long cap (32768 here): the same greedy
    tokens as eagerly, its decode steps replayed (eagerly none would be)."""
    path = _model(tmp_path, 256, 4, 2, 40000)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (9000, 30)]
    outs = {}
    for graphs in (True, False):
        engine = make_engine(path, device="cuda", dtype="float32", num_blocks=1024, kernels="cuda",
                             cuda_graphs=graphs, max_num_seqs=4)
        outs[graphs] = run_engine(engine, prompts, max_new_tokens=16, min_new_tokens=16)
        if graphs:
            g = engine.runner.graphs
            assert [(c.cap, c.max_batch) for c in g.caps][-2:] == [(32768, 4), (40000, 4)]
            assert g.replays >= 10 and len(g.caps[3].graphs) == 3             # buckets 1, 2, 4
    assert outs[True] == outs[False]


def test_graph_logits_match_eager_in_bf16(tmp_path):
    """The logits a graph replay gives equal the eager step's (bf16, the CuPy kernels)."""
    path = _model(tmp_path, 512, 4, 1, 2048)
    engine = make_engine(path, device="cuda", dtype="bfloat16", num_blocks=512, kernels="cuda", max_num_seqs=4)
    three_decoding(engine, random.Random(3))
    plan = engine.scheduler.schedule()
    assert plan.num_decodes == 3
    graphed = engine.runner.execute(plan).clone()
    replays = engine.runner.graphs.replays
    graphs, engine.runner.graphs = engine.runner.graphs, None
    eager = engine.runner.execute(plan)
    engine.runner.graphs = graphs
    assert graphs.replays == replays and replays > 0
    assert torch.linalg.norm(graphed - eager) / torch.linalg.norm(eager) < 1e-2


def test_an_unsampled_one_token_row_anywhere_takes_the_eager_path(tmp_path):
    """A graph gives logits for every row, the sampler takes one per sampled row: a decode-only plan with an
    unsampled one-token row (a prompt chunk cut to one token) ahead of sampled ones is not replayed."""
    path = _model(tmp_path, 256, 4, 1, 2048)
    engine = make_engine(path, device="cuda", dtype="float32", num_blocks=512, kernels="cuda", max_num_seqs=4)
    three_decoding(engine, random.Random(5))
    plan = engine.scheduler.schedule()
    assert plan.num_decodes == 3 and all(s.sample for s in plan.seqs)
    assert engine.runner.graphs.run(plan) is not None
    plan.seqs[0].sample = False
    assert engine.runner.graphs.run(plan) is None
    assert engine.runner.execute(plan).shape[0] == 2          # the eager path: the two sampled rows' logits


def test_memory_plan_sizes_the_pool(tmp_path):
    """With no kv_cache_memory on a GPU, the pool is what gpu_memory_utilization leaves after a profiling step;
    what is allocated stays within that share; an impossible share is an error naming it."""
    path = _model(tmp_path, 256, 4, 2, 2048)
    engine = make_engine(path, device="cuda", dtype="bfloat16", kernels="cuda", gpu_memory_utilization=0.2)
    plan = engine.memory_plan
    assert plan is not None and engine.num_blocks == plan.num_blocks > 0
    total = torch.cuda.mem_get_info()[1]
    assert plan.total == total
    assert plan.weights + plan.activations + plan.kv_bytes + plan.graph_reserve <= 0.2 * total
    assert torch.cuda.memory_allocated() <= 0.2 * total
    assert "KV pool" in plan.describe()
    runner = engine.runner                            # the runner captured both kinds; the plan reads their sum
    assert runner.graph_memory == runner.graphs.memory + runner.piecewise.memory
    assert engine.config.scheduler.max_batch_tokens == 2048 and engine.config.scheduler.max_num_seqs == 256
    del engine
    with pytest.raises(mii_async.InvalidParameterError) as e:
        make_engine(path, device="cuda", dtype="bfloat16", kernels="cuda", gpu_memory_utilization=0.0001)
    assert e.value.param == "gpu_memory_utilization"
