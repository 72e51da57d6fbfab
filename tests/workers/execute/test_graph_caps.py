"""Which decode graphs are captured: the context caps and the largest batch each holds (no GPU needed)."""
from __future__ import annotations

from mii_async.workers.execute.cuda_graphs import LONG_CAP_BATCH, batch_buckets, context_caps, graph_reserve


def test_short_contexts_keep_the_caps_every_batch_uses():
    assert context_caps(4096, 256) == [(512, 256), (2048, 256), (4096, 256)]
    assert context_caps(8192, 256) == [(512, 256), (2048, 256), (8192, 256)]
    assert context_caps(300, 4) == [(300, 4)]


def test_long_contexts_add_caps_four_times_longer_for_small_batches():
    assert context_caps(131072, 256) == [(512, 256), (2048, 256), (8192, 256), (32768, LONG_CAP_BATCH),
                                         (131072, LONG_CAP_BATCH)]
    assert context_caps(40000, 256)[3:] == [(32768, LONG_CAP_BATCH), (40000, LONG_CAP_BATCH)]
    assert context_caps(10000, 2)[3:] == [(10000, 2)]           # never more sequences than the largest batch


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    b = batch_buckets(256)
    assert b[:6] == [1, 2, 4, 8, 16, 24] and b[-1] == 256 and b == sorted(set(b))


def test_the_reserve_counts_the_longest_caps_splits():
    """Past 8192 tokens the reserve adds the longest cap's decode splits: fp32 partials, maxima and sums of every
    query head in 512-token splits (8 sequences × 32 heads × 256 splits × 130 floats at 131072); nothing below
    8192, and no more sequences than the largest batch."""
    assert graph_reserve(256, 128256, 8192, 32, 128) == graph_reserve(256, 128256)
    assert graph_reserve(256, 128256, 131072, 32, 128) == graph_reserve(256, 128256) + 8 * 32 * 256 * 130 * 4
    assert graph_reserve(4, 128256, 131072, 32, 128) == graph_reserve(4, 128256) + 4 * 32 * 256 * 130 * 4
