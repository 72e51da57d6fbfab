"""The runner's graph plan: which CUDA graphs a GPU runner captures and how large, and what the memory plan sets
aside for them. Pure arithmetic over the config and the model's shapes: it runs on the CPU."""
from __future__ import annotations

import pytest
import torch

from mii_async.config import EngineConfig

from ..helpers import make_engine


def _plan(device: str, tp=None, **options):
    from mii_async.workers.engine_build import _graph_plan

    config = EngineConfig.from_kwargs("unused", **options)
    config = EngineConfig(config.model, config.cache, config.scheduler.resolved(torch.device(device).type))
    return _graph_plan(config, torch.device(device), 4096, tp)


def test_the_builder_plans_graphs_on_a_single_gpu_only():
    """Graphs on a GPU replica with cuda_graphs; none on the CPU, with cuda_graphs off, or with tensor
    parallelism; piecewise graphs only with piecewise_graphs, their steps capped at 2048 tokens."""
    from mii_async.workers.execute.piecewise_graphs import MAX_TOKENS

    plan = _plan("cuda", max_num_seqs=8, max_batch_tokens=512)
    assert (plan.max_batch, plan.max_context, plan.piecewise_tokens, plan.max_rows) == (8, 4096, 512, 8)
    assert _plan("cuda", piecewise_graphs=False, max_num_seqs=8).piecewise_tokens == 0
    wide = _plan("cuda", max_num_seqs=1024, max_batch_tokens=8192, max_mixed_batch_tokens=8192)
    assert (wide.max_batch, wide.piecewise_tokens, wide.max_rows) == (512, MAX_TOKENS, 1024)
    assert _plan("cpu") is None
    assert _plan("cuda", cuda_graphs=False) is None
    assert _plan("cuda", tp=object()) is None


def test_the_reserve_counts_piecewise_graphs_only_when_planned(tiny_model):
    """A plan's reserve is the decode graphs' (by the largest batch and the vocabulary), plus the piecewise
    graphs' when it asks for them."""
    from mii_async.workers.execute.cuda_graphs import graph_reserve
    from mii_async.workers.execute.piecewise_graphs import piecewise_reserve
    from mii_async.workers.execute.runner import GraphPlan

    model = make_engine(tiny_model("llama"), num_blocks=16).model
    decode_only = GraphPlan(max_batch=8, max_context=256, piecewise_tokens=0, max_rows=8)
    both = GraphPlan(max_batch=8, max_context=256, piecewise_tokens=100, max_rows=8)
    assert decode_only.reserve(model) == graph_reserve(8, model.spec.vocab_size)    # no cap past 8192
    assert both.reserve(model) == decode_only.reserve(model) + piecewise_reserve(model, 100)
    with pytest.raises(AssertionError):
        GraphPlan(max_batch=0, max_context=256, piecewise_tokens=0, max_rows=0)


def test_a_cpu_runner_captures_no_graphs(tiny_model):
    """CUDA graphs are the GPU's: a CPU runner refuses to capture and holds none (its graph memory is 0)."""
    from mii_async.workers.execute.runner import GraphPlan

    runner = make_engine(tiny_model("llama"), num_blocks=16).runner
    assert runner.graphs is None and runner.piecewise is None and runner.graph_memory == 0
    with pytest.raises(AssertionError):
        runner.capture(GraphPlan(max_batch=4, max_context=64, piecewise_tokens=0, max_rows=4), scratch_block=15)
