"""MemoryPlan: on a GPU, how big the KV pool can be, measured rather than guessed.

After the weights are loaded, one profiling step runs the worst step the scheduler can plan — `max_batch_tokens`
tokens spread over up to `max_num_seqs` sequences, every sequence sampled with top-k and top-p, as many prompt
positions scored for prompt logprobs as a step may score — on a scratch KV cache, and the peak of torch's
allocator over it is the activation memory a step needs. The pool gets the rest
of `gpu_memory_utilization` × the device's memory, less memory used outside torch (the CUDA context, cuBLAS,
other processes) and a reserve for the CUDA graphs captured afterwards (`graph_reserve`, measured once they are
captured and reported next to it).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mii_async.params import SamplingParams

from ..sampling.prompt_logprobs import launch_scores
from ..core.scheduler import MAX_SCORED_ROWS
from ..core.step_plan import ScheduledSeq, StepPlan

GIB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    total: int                  # the device's memory, bytes
    utilization: float          # gpu_memory_utilization
    weights: int                # torch-allocated when the profile started (the weights)
    activations: int            # peak over the profiling step, beyond the weights
    non_torch: int              # used outside torch's allocator (CUDA context, libraries, other processes)
    graph_reserve: int          # set aside for the captured graphs (decode, piecewise)
    kv_bytes_per_block: int
    num_blocks: int
    block_size: int
    max_batch_tokens: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    def describe(self) -> str:
        g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        return (f"memory plan: {self.utilization:.0%} of {g(self.total)} = weights {g(self.weights)} + "
                f"activations {g(self.activations)} (a step of {self.max_batch_tokens} tokens) + outside torch "
                f"{g(self.non_torch)} + CUDA graphs {g(self.graph_reserve)} + KV pool {g(self.kv_bytes)} "
                f"({self.num_blocks} blocks of {self.block_size} tokens = {self.num_blocks * self.block_size} tokens)")


def profile_step(model, sampler, num_layers: int, block_shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                 max_batch_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 runner_cls) -> int:
    """Runs the heaviest step the scheduler may plan, on a scratch KV cache just big enough for it; returns
    the scratch cache's bytes (not activations: the real pool replaces it)."""
    from ..core.sequence import Sequence

    tokens = max(1, min(max_batch_tokens, max_num_seqs * max_model_len))
    nseq = max(1, min(max_num_seqs, tokens))
    lens = [tokens // nseq + (1 if i < tokens % nseq else 0) for i in range(nseq)]
    blocks_per = [-(-n // block_size) for n in lens]
    n_blocks = sum(blocks_per)
    scratch = [(torch.zeros((n_blocks, *block_shape), dtype=dtype, device=device),
                torch.zeros((n_blocks, *block_shape), dtype=dtype, device=device)) for _ in range(num_layers)]
    seqs, nxt, scored = [], 0, 0
    for i, n in enumerate(lens):
        table = list(range(nxt, nxt + blocks_per[i]))
        nxt += blocks_per[i]
        seqs.append(ScheduledSeq(i, [1] * n, 0, table, True))
        if (k := min(n - 1, MAX_SCORED_ROWS - scored)) > 0:      # prompt logprobs' rows, as many as a step
            seqs[-1].score_to = k                                 # may score
            scored += k
    plan = StepPlan(seqs, num_decodes=sum(1 for n in lens if n == 1), num_scored=scored)
    logits = runner_cls(model, scratch, block_size, device).execute(plan)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, logprobs=5,
                            prompt_logprobs=20)
    requests = [Sequence(-1 - i, [1] * n, params) for i, n in enumerate(lens)]
    if scored:
        launch_scores(plan, requests, logits[len(lens):])
    sampler(logits[:len(lens)], requests)
    for i in range(len(lens)):
        sampler.release(-1 - i)
    scratch_bytes = sum(k.nbytes + v.nbytes for k, v in scratch)
    del logits, scratch
    torch.cuda.synchronize(device)
    return scratch_bytes


def plan_kv(profile, device: torch.device, utilization: float, kv_bytes_per_block: int, block_size: int,
            max_batch_tokens: int, graph_reserve: int) -> MemoryPlan:
    """Calls `profile()` (the profiling step, returning the bytes of its scratch cache) and sizes the pool
    from what it measured."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    scratch = profile()
    peak = torch.cuda.max_memory_allocated(device) - scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    activations = max(0, peak - weights)
    budget = int(total * utilization) - weights - activations - non_torch - graph_reserve
    num_blocks = budget // kv_bytes_per_block
    if num_blocks < 1:
        from mii_async.errors import InvalidParameterError

        raise InvalidParameterError("gpu_memory_utilization", f"no room for a KV pool: {utilization:.0%} of {total / GIB:.1f} GiB leaves "
                          f"{budget / GIB:.2f} GiB after the weights ({weights / GIB:.2f} GiB), activations "
                          f"({activations / GIB:.2f} GiB) and the rest; raise gpu_memory_utilization, or lower "
                          "max_batch_tokens or max_num_seqs")
    return MemoryPlan(total, utilization, weights, activations, non_torch, graph_reserve, kv_bytes_per_block,
                      int(num_blocks), block_size, max_batch_tokens)


def warn_limits(asked_len: int | None, model_len: int, max_model_len: int, pool_tokens: int) -> None:
    """Says when the deployment is less than what was asked or than one request at full length needs: a
    max_model_len past the model's positions (cut to them), or a KV pool smaller than max_model_len (longer
    requests are refused)."""
    log = logging.getLogger("mii_async.workers.engine")
    if asked_len and asked_len > model_len:
        log.warning("max_model_len %d is past the model's limit (its positions, or its sliding window): it is %d",
                    asked_len, model_len)
    if pool_tokens < max_model_len:
        log.warning("the KV pool holds %d tokens, fewer than max_model_len (%d): a request longer than the pool "
                    "is refused", pool_tokens, max_model_len)
