"""Building an engine: the model, the KV pool sized by the memory plan, the runner with its captured graphs, the
block manager, the scheduler and the sampler, in the order the memory plan needs them.

The order matters on a GPU: the memory plan profiles one step of the loaded model (with the sampler) before
any KV block exists, sets aside what the graphs will take, and gives the rest to the pool; the graphs are
captured last, over the pool they read.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mii_async.config import EngineConfig, SchedulerConfig
from mii_async.errors import InvalidParameterError
from mii_async.kernels import get_ops, resolve_backend
from mii_async.kernels.config import KernelConfig
from mii_async.kernels.kv_store import kv_dtype
from mii_async.model_source import resolve_model

from .core.block_manager import BlockManager
from .core.scheduler import Scheduler
from .cpu_plan import StepThreads, apply_threads, auto_quantization
from .cpu_plan import describe as describe_cpu
from .execute import kv_cache
from .execute.memory_plan import MemoryPlan, plan_kv, profile_step, warn_limits
from .execute.piecewise_graphs import MAX_TOKENS as PIECEWISE_MAX_TOKENS
from .execute.runner import GraphPlan, Runner
from .model.decoder import DecoderModel
from .model.loader import TensorReader, WeightReader, load_quantization, load_spec
from .model.parallel import TPGroup
from .model.registry import model_class
from .model.spec import ModelSpec
from .sampling.sampler import Sampler

log = logging.getLogger("mii_async.workers.engine")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineParts:
    """What one replica (one rank of it, with TP) serves with; the Engine advances them a step at a time."""
    config: EngineConfig                # as given, with its scheduler settings resolved for the device
    model_path: Path                    # the model's directory (config.json, tokenizer, weights)
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype                  # of the weights and the KV pool
    kernels: str                        # the op set, resolved: "cuda" | "reference"
    max_model_len: int                  # tokens one sequence may reach: the model's context, or less if asked
    tp: TPGroup | None                  # this rank's group, with tensor parallelism
    model: DecoderModel
    load_seconds: float                 # reading and placing the weights
    memory_plan: MemoryPlan | None      # how the device's memory was shared out (a GPU whose pool was sized)
    num_blocks: int                     # KV blocks the block manager hands out (same on every rank)
    kv: list[tuple[torch.Tensor, torch.Tensor]]   # per layer (K, V), each [blocks, block_size, kv_heads, head_dim]
    block_manager: BlockManager
    scheduler: Scheduler
    runner: Runner                      # with its decode and piecewise graphs, captured, where they apply
    sampler: Sampler
    async_scheduling: bool              # launch step N+1 before reading step N's ids


def build(config: EngineConfig, model_path: Path | None = None, tp: TPGroup | None = None,
          weights: dict[str, torch.Tensor] | None = None) -> EngineParts:
    """With `tp`, this process is one rank of a tensor-parallel replica: it holds its shard of the weights and of
    the KV pool. `weights` (name → tensor) replaces the checkpoint's files: the model directory then needs only
    its config.json. Raises InvalidParameterError for a kernel set the device cannot run."""
    mc = config.model
    model_path = model_path or resolve_model(mc.model, mc.cache_dir)
    spec = load_spec(model_path)
    device = torch.device(mc.device if mc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)   # the kernels launch on the current device of the thread that builds
                                        # and steps the engine
    quantization, why = mc.quantization, "as asked"
    if device.type == "cpu":
        quantization, why = auto_quantization(mc.model, model_path, mc.dtype, mc.quantization)
        threads = apply_threads(mc.threads, tp.world if tp is not None else 1)
    elif quantization == "int4":
        raise InvalidParameterError("quantization", "int4 is the CPU's weight-only scheme; on a GPU use fp8")
    # int4's GEMMs take bf16 activations on their fast path (kernels/int_weight.py): its default dtype
    auto = "float32" if device.type == "cpu" and quantization != "int4" else "bfloat16"
    dtype = _DTYPES[mc.dtype if mc.dtype != "auto" else auto]
    try:
        kernels = resolve_backend(mc.kernels, device.type)
        kernel_config = KernelConfig.from_env(os.environ)   # $MII_ASYNC_DECODE, _DECODE_GRID, _PDL: read once, here
    except ValueError as exc:
        raise InvalidParameterError("kernels", str(exc)) from None
    if device.type == "cpu" and (tp is None or tp.rank == 0):
        log.info("%s", describe_cpu(str(dtype).removeprefix("torch."), quantization, why, threads, kernels,
                                    mc.kernels))
    limit = spec.max_position_embeddings      # a sliding window does not cap it: those layers attend within it
    max_model_len = min(mc.max_model_len or limit, limit)
    t0 = time.perf_counter()
    kv_dt = kv_dtype(config.cache.kv_cache_dtype, dtype)
    if kv_dt != dtype and kernels == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise InvalidParameterError("kv_cache_dtype", "an fp8 KV cache on the CUDA kernels needs a GPU with FP8 "
                                    "conversions (compute capability 8.9 or later); kernels='reference' runs it "
                                    "anywhere")
    quant = load_quantization(model_path, quantization)
    if kv_dt != dtype and quant is not None and quant.kv_scales:    # the e4m3 cache takes the calibrated scales
        quant = dataclasses.replace(quant, fold_kv_scales=True)
    reader = TensorReader(weights) if weights is not None else WeightReader(model_path)
    model = model_class(spec).load(spec, reader, dtype, device, max_model_len, get_ops(kernels, kernel_config), tp,
                                   quant=quant)
    kv_spec = dataclasses.replace(spec, num_kv_heads=model.num_kv_heads)   # this rank's KV heads
    load_seconds = time.perf_counter() - t0
    cc = config.cache
    sched = config.scheduler.resolved(device.type)
    config = dataclasses.replace(config, scheduler=sched)
    sampler = Sampler(spec.vocab_size, spec.eos_token_ids, device)
    graph_plan = _graph_plan(config, device, max_model_len, tp)
    memory_plan = None
    per_block = kv_cache.bytes_per_block(kv_spec, cc.block_size, kv_dt)
    if cc.num_blocks:
        num_blocks = cc.num_blocks
    elif device.type != "cuda" or cc.kv_cache_memory is not None:
        num_blocks = int((cc.kv_cache_memory or cc.CPU_KV_GIB) * 2**30 // per_block)
    else:
        reserve = graph_plan.reserve(model) if graph_plan is not None else 0
        memory_plan = _plan_memory(config, model, sampler, kv_spec, per_block, kv_dt, device, max_model_len,
                                   reserve)
        num_blocks = memory_plan.num_blocks
    num_blocks = max(1, num_blocks) if tp is None else tp.min_int(max(1, num_blocks))   # same ids on all ranks
    if tp is None or tp.rank == 0:
        warn_limits(mc.max_model_len, limit, max_model_len, num_blocks * cc.block_size)
    # With graphs, one more block than the block manager knows: the scratch block of padded rows.
    kv = kv_cache.allocate(kv_spec, num_blocks + int(graph_plan is not None), cc.block_size, kv_dt, device)
    block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
    scheduler = Scheduler(sched, block_manager)
    runner = Runner(model, kv, cc.block_size, device)
    if device.type == "cpu" and tp is None:
        runner.step_threads = StepThreads(threads)
    if graph_plan is not None:
        runner.capture(graph_plan, scratch_block=num_blocks)
    if memory_plan is not None:
        _log_plan(memory_plan, runner, sched)
    async_scheduling = sched.async_scheduling if sched.async_scheduling is not None else device.type == "cuda"
    if tp is not None:
        async_scheduling = False   # the other ranks would need the device ids too: not yet
    return EngineParts(config, model_path, spec, device, dtype, kernels, max_model_len, tp, model, load_seconds,
                       memory_plan, num_blocks, kv, block_manager, scheduler, runner, sampler, async_scheduling)


def _graph_plan(config: EngineConfig, device: torch.device, max_model_len: int, tp: TPGroup | None) -> GraphPlan | None:
    """The CUDA graphs the runner captures (`config.scheduler` resolved), or None: not on a GPU, not with
    cuda_graphs off, not yet with tensor parallelism."""
    mc, sched = config.model, config.scheduler
    if device.type != "cuda" or not mc.cuda_graphs or tp is not None:
        return None
    piecewise_tokens = min(sched.max_mixed_batch_tokens or sched.max_batch_tokens, PIECEWISE_MAX_TOKENS)
    return GraphPlan(max_batch=min(sched.max_num_seqs, 512), max_context=max_model_len,
                     piecewise_tokens=piecewise_tokens if mc.piecewise_graphs else 0, max_rows=sched.max_num_seqs)


def _plan_memory(config: EngineConfig, model: DecoderModel, sampler: Sampler, kv_spec: ModelSpec, per_block: int,
                 dtype: torch.dtype, device: torch.device, max_model_len: int, reserve: int) -> MemoryPlan:
    """The KV pool's share of the device: what is left of gpu_memory_utilization after the weights, one
    profiled step of max_batch_tokens (over a scratch cache of the pool's `dtype`) and `reserve` bytes for the
    graphs."""
    cc, sched = config.cache, config.scheduler
    block_shape = (cc.block_size, kv_spec.num_kv_heads, kv_spec.head_dim)
    return plan_kv(lambda: profile_step(model, sampler, kv_spec.num_layers, block_shape, dtype, device,
                                        sched.max_batch_tokens, sched.max_num_seqs, max_model_len, cc.block_size,
                                        Runner),
                   device, cc.gpu_memory_utilization, per_block, cc.block_size, sched.max_batch_tokens, reserve)


def _log_plan(plan: MemoryPlan, runner: Runner, sched: SchedulerConfig) -> None:
    measured = runner.graph_memory
    if measured > plan.graph_reserve:
        log.warning("the CUDA graphs took %.2f GiB, more than the %.2f GiB the memory plan set aside",
                    measured / 2**30, plan.graph_reserve / 2**30)
    log.info("%s; graphs measured %.2f GiB; token budget %d per step (%d while requests decode%s), %d "
             "sequences at most", plan.describe(), measured / 2**30, sched.max_batch_tokens,
             sched.max_mixed_batch_tokens,
             f"; steps cut to multiples of {m}" if (m := sched.step_token_multiple or 1) > 1 else "",
             sched.max_num_seqs)
