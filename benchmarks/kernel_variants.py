"""Decode-attention variants on one engine: a KernelConfig per (mma block width, grid order), its op set, and
decode graphs captured with it, so that a probe compares variants in one process without touching any module
state. A captured graph keeps the kernels it was captured with, so each variant's graphs are its own; eager
steps (and the attention between piecewise graphs' pieces) take the op set the model holds."""
from __future__ import annotations

import dataclasses
import gc
from typing import NamedTuple

import torch

from mii_async.kernels import get_ops
from mii_async.kernels.config import KernelConfig
from mii_async.kernels.op_set import OpSet
from mii_async.workers.execute.cuda_graphs import DecodeGraphs


class Variant(NamedTuple):
    ops: OpSet                          # the model's op set while the variant runs
    graphs: DecodeGraphs | None         # its decode graphs; None: the engine runs eager


def variant_config(base: KernelConfig, warps: int | None, grid: str | None) -> KernelConfig:
    """`base` with the mma kernel at `warps` (2 or 4) a block for every batch and decode attention in grid
    order `grid`; None keeps base's choice."""
    narrow = base.mma_narrow_from if warps is None else (0 if warps == 2 else None)
    return dataclasses.replace(base, mma_narrow_from=narrow, decode_grid=grid or base.decode_grid)


def capture_variant(engine, config: KernelConfig) -> Variant:
    """The op set of `config` and decode graphs captured with it for every batch the engine's cover: a set
    beside the engine's (the bench's memory plan leaves room). The engine's own config keeps its own graphs."""
    model = engine.model
    if config == model.ops.config:
        return Variant(model.ops, engine.runner.graphs)
    ops = get_ops(engine.kernels, config)
    if engine.runner.graphs is None:
        return Variant(ops, None)
    own, model.ops = model.ops, ops             # captured with this variant's op set
    try:
        graphs = _decode_graphs(engine)
        graphs.capture()
    finally:
        model.ops = own
    return Variant(ops, graphs)


def use_variant(engine, variant: Variant) -> Variant:
    """Makes `variant` the engine's (its op set on the model, its decode graphs on the runner); returns the
    one it replaces."""
    before = Variant(engine.model.ops, engine.runner.graphs)
    engine.model.ops, engine.runner.graphs = variant
    return before


def recapture(engine, config: KernelConfig) -> None:
    """Makes `config` the engine's for the rest of the process: its decode graphs are dropped, then captured
    again with the new op set (so the memory plan's room for one set holds them)."""
    if config == engine.model.ops.config:
        return
    engine.model.ops = get_ops(engine.kernels, config)
    if engine.runner.graphs is None:
        return
    graphs = _decode_graphs(engine)
    engine.runner.graphs = None                 # the old set's graph pool goes back to the device
    gc.collect()
    torch.cuda.empty_cache()
    graphs.capture()
    engine.runner.graphs = graphs


def _decode_graphs(engine) -> DecodeGraphs:
    """Decode graphs, not captured yet, of the same batches, context caps and scratch block as the engine's."""
    g = engine.runner.graphs
    return DecodeGraphs(engine.model, g.kv_caches, g.block_size, g.device, g.buckets[-1], engine.max_model_len,
                        scratch_block=g.scratch_slot // g.block_size)
