"""The decode kernels' split lengths (kernels/decode_attention.split_lengths): whole waves of the resident
blocks, shared evenly, for a few sequences over long contexts; the tuned lengths, fixed, for many. Plain
arithmetic, no GPU."""
from __future__ import annotations

import pytest

from mii_async.kernels.decode_attention import EVEN_SPLIT_MIN, PARTITIONS, split_lengths

H100_SMS, MMA_SLOTS = 132, 3 * 132          # the tensor-core kernel at 4 warps: 3 blocks an SM


def split_partition(pairs: int, span: int, sms: int, slots: int, block_size: int) -> int:
    return split_lengths(pairs, span, sms, slots, block_size)[0]


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


@pytest.mark.parametrize("pairs, span", [(8, 32768), (4, 32768), (16, 8192), (8, 2048)])
def test_whole_wave_splits_are_shared_evenly(pairs, span):
    """Where the waves choose the length, a sequence shorter than the span spreads over the splits (down to 32
    tokens a split): a CUDA graph launches them for its cap."""
    p, least = split_lengths(pairs, span, H100_SMS, MMA_SLOTS, 16)
    assert least == min(p, EVEN_SPLIT_MIN)


@pytest.mark.parametrize("pairs, span", [(2048, 704), (512, 1024), (32, 32768)])
def test_many_pairs_keep_fixed_splits(pairs, span):
    """A launch that fills the card as it is keeps fixed splits: even ones would add partial outputs."""
    p, least = split_lengths(pairs, span, H100_SMS, MMA_SLOTS, 16)
    assert least == p
    assert split_lengths(pairs, span, H100_SMS, 0, 16) == (p, p)
