"""The decode kernels' split length (kernels/decode_attention.split_partition): whole waves of the resident
blocks for a few sequences over long contexts, the tuned lengths for many. Plain arithmetic, no GPU."""
from __future__ import annotations

import pytest

from mii_async.kernels.decode_attention import PARTITIONS, split_partition

H100_SMS, MMA_SLOTS = 132, 3 * 132          # the tensor-core kernel at 4 warps: 3 blocks an SM


def blocks(pairs: int, span: int, partition: int) -> int:
    return pairs * -(-span // partition)


def test_one_sequence_over_32k_tokens_fills_one_wave():
    # 8 KV heads: 512-token partitions would give 512 blocks, one wave and 116 blocks of another.
    p = split_partition(8, 32768, H100_SMS, MMA_SLOTS, 16)
    assert p % 16 == 0 and blocks(8, 32768, p) <= MMA_SLOTS
    assert blocks(8, 32768, p - 16) > MMA_SLOTS                 # the shortest that does


@pytest.mark.parametrize("pairs, span", [(8, 4096), (8, 16384), (4, 32768), (128, 1024), (8, 32000)])
def test_few_pairs_never_take_more_waves_of_tokens_than_the_tuned_length(pairs, span):
    tuned = split_partition(pairs, span, H100_SMS, 0, 16)
    p = split_partition(pairs, span, H100_SMS, MMA_SLOTS, 16)
    def waves(part: int) -> int:
        return -(-blocks(pairs, span, part) // MMA_SLOTS)

    assert waves(p) * p <= waves(tuned) * tuned
    assert p >= 32 and p % 16 == 0


@pytest.mark.parametrize("pairs, span", [(2048, 704), (512, 1024), (32, 32768), (8, 128)])
def test_many_pairs_or_short_contexts_keep_the_tuned_lengths(pairs, span):
    p = split_partition(pairs, span, H100_SMS, MMA_SLOTS, 16)
    assert p in PARTITIONS and p == split_partition(pairs, span, H100_SMS, 0, 16)


def test_unknown_occupancy_keeps_the_tuned_lengths():
    assert split_partition(8, 32768, H100_SMS, 0, 16) == 512


def test_partitions_hold_whole_cache_blocks():
    for bs in (16, 32, 64):
        for span in (4096, 32000, 131072):
            p = split_partition(8, span, H100_SMS, MMA_SLOTS, bs)
            assert p % bs == 0 and p % 16 == 0, (bs, span, p)
