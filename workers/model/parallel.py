"""Tensor parallelism: the shard plan of a Llama-family model, the process group, the step-plan broadcast.

Megatron-style: QKV and gate|up are column-parallel (each rank holds a slice of the heads and of the FFN),
o_proj and down are row-parallel and followed by an all-reduce; the embedding and lm_head are vocab-parallel
(each rank holds V/T rows: the embedding lookup is masked and all-reduced, the logits are all-gathered for the
sampler on rank 0). KV heads are sharded when T divides them; when T exceeds them, each rank keeps the one KV
head its query heads use (replicated), so GQA stays exact. Every rank holds the KV of its heads only, under
block tables identical on every rank: rank 0 schedules and broadcasts each step's plan, as msgpack bytes in a
uint8 tensor over the group (never pickle), and the other ranks run the same forward.

gloo on CPU (tests), NCCL on GPU. The group is the replica's T worker processes, rendezvousing at
`init_method` (a TCP address the router picks per replica start).
"""
from __future__ import annotations

import datetime
import time
import msgpack
import torch
import torch.distributed as dist

from ..core.step_plan import ScheduledSeq, StepPlan


class TPGroup:
    """This process's place in its replica's tensor-parallel group."""

    def __init__(self, rank: int, world: int, init_method: str, device: torch.device, timeout_s: float = 600) -> None:
        self.rank, self.world, self.device = rank, world, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self._len = torch.zeros(1, dtype=torch.int64, device=device)
        self.plan_seconds = 0.0          # rank 0: time spent broadcasting plans (reported in engine stats)
        self.plans_sent = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def min_int(self, value: int) -> int:
        """The least of `value` over the group (every rank calls it at the same point)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank → [..., world·n], rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, -1)

    # -- the step plan, rank 0 → the others ----------------------------------------------------------
    def send_plan(self, plan: StepPlan | None) -> None:
        """Rank 0: the plan every rank runs next; None tells the others to stop."""
        assert self.rank == 0, "only the leader sends plans"
        t0 = time.perf_counter()
        payload = b"" if plan is None else _encode_plan(plan)
        self._len.fill_(len(payload) if plan is not None else -1)
        dist.broadcast(self._len, 0)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device), 0)
        self.plan_seconds += time.perf_counter() - t0
        self.plans_sent += 1

    def recv_plan(self) -> StepPlan | None:
        dist.broadcast(self._len, 0)
        n = int(self._len.item())
        if n < 0:
            return None
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, 0)
        return _decode_plan(buf.cpu().numpy().tobytes())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _encode_plan(plan: StepPlan) -> bytes:
    return msgpack.packb([plan.num_decodes, plan.num_scored,
                          [[s.req_id, s.token_ids, s.start_pos, s.block_table, s.sample, s.score_from, s.score_to]
                           for s in plan.seqs]])


def _decode_plan(data: bytes) -> StepPlan:
    num_decodes, num_scored, seqs = msgpack.unpackb(data)
    return StepPlan([ScheduledSeq(*s) for s in seqs], num_decodes, num_scored=num_scored)
