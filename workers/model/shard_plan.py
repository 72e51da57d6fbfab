"""ShardPlan: which heads, FFN rows and vocabulary rows one tensor-parallel rank holds. Plain ints, no torch,
so that the router can check a `tensor_parallel` against the model's config before it starts any worker."""
from __future__ import annotations

from dataclasses import dataclass

from mii_async.errors import InvalidParameterError


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world: int
    q_heads: tuple[int, int]        # this rank's query heads [start, end)
    kv_heads: tuple[int, int]       # this rank's KV heads [start, end) (one replicated head when T > Hkv)
    ffn: tuple[int, int]            # this rank's rows of gate/up (columns of down)
    vocab: tuple[int, int]          # this rank's embedding / lm_head rows
    vocab_per_rank: int             # ceil(V / T): every rank's logits are padded to this for the all-gather

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def shard_plan(num_heads: int, num_kv_heads: int, intermediate: int, vocab: int, rank: int, world: int) -> ShardPlan:
    """Raises InvalidParameterError naming the head counts when `world` does not fit them."""
    if num_heads % world:
        raise InvalidParameterError("tensor_parallel", f"{world} does not divide the model's {num_heads} attention "
                                    f"heads (num_kv_heads {num_kv_heads}); choose a divisor of {num_heads}")
    if num_kv_heads % world and world % num_kv_heads:
        raise InvalidParameterError("tensor_parallel", f"{world} neither divides nor is a multiple of the model's "
                                    f"{num_kv_heads} KV heads (num_heads {num_heads})")
    if intermediate % world:
        raise InvalidParameterError("tensor_parallel", f"{world} does not divide intermediate_size {intermediate}")
    qn = num_heads // world
    q = (rank * qn, (rank + 1) * qn)
    if num_kv_heads >= world:
        kn = num_kv_heads // world
        kv = (rank * kn, (rank + 1) * kn)
    else:                                      # replicate: the KV head that this rank's query heads share
        group = num_heads // num_kv_heads
        k = q[0] // group
        assert (q[1] - 1) // group == k, "a rank's query heads must share one KV head"
        kv = (k, k + 1)
    fn = intermediate // world
    vn = -(-vocab // world)
    if (world - 1) * vn >= vocab:
        raise InvalidParameterError("tensor_parallel", f"{world} ranks would leave one without vocabulary rows "
                                    f"(vocab_size {vocab})")
    return ShardPlan(rank, world, q, kv, (rank * fn, (rank + 1) * fn),
                     (min(vocab, rank * vn), min(vocab, (rank + 1) * vn)), vn)


def expert_ffn(shard: ShardPlan, moe_intermediate: int) -> tuple[int, int]:
    """This rank's rows [start, end) of every expert's gate/up (columns of its down): F/T of each expert, as
    `ffn` is of the dense MLP. Raises InvalidParameterError naming moe_intermediate_size when T does not
    divide it."""
    if moe_intermediate % shard.world:
        raise InvalidParameterError("tensor_parallel", f"{shard.world} does not divide the experts' "
                                    f"moe_intermediate_size {moe_intermediate}")
    fn = moe_intermediate // shard.world
    return shard.rank * fn, (shard.rank + 1) * fn
