"""What cuDNN's prompt attention is given each step (kernels/cudnn_prefill.step_inputs): the chunks' packed
offsets, lengths and block tables, padded to the step's bucket. Plain tensors on the CPU; the attention itself
is checked on a GPU (tests/kernels/test_cuda_kernels.py)."""
from __future__ import annotations

import torch

from mii_async.kernels import cudnn_prefill as C
from mii_async.kernels.metadata import AttentionMetadata


def _meta(query_lens: list[int], context_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    nd = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    return AttentionMetadata(torch.zeros(sum(query_lens), dtype=torch.int64), tables, torch.tensor(context_lens),
                             starts, nd, max(context_lens), list(query_lens), list(context_lens))


def test_buckets_are_powers_of_four_from_a_floor():
    assert [C.bucket(n, 1) for n in (0, 1, 2, 4, 5, 16, 17)] == [1, 1, 4, 4, 16, 16, 64]
    assert C.bucket(100, 128) == 128 and C.bucket(129, 128) == 512 and C.bucket(2048, 128) == 2048


def test_step_inputs_cover_the_chunks_after_the_decodes():
    """Two decodes, then chunks of 5, 300 and 1 tokens over contexts of 5, 1000 and 70: three sequences padded
    to four; offsets in elements of the packed rows (H·D a token), counted from the first chunk's row; padded
    sequences with no queries, no keys and the last offset repeated; each table cut from the step's to the
    bucket's pages (1024 at least), zeros past it."""
    heads, d, bs = 4, 8, 16
    qlens, clens = [1, 1, 5, 300, 1], [40, 7, 5, 1000, 70]
    tables = torch.arange(len(clens) * 63, dtype=torch.int64).view(len(clens), 63)
    meta = _meta(qlens, clens, tables)
    meta = meta._replace(num_decodes=2)
    inputs = C.step_inputs(meta, heads, d, bs, torch.device("cpu"))
    assert inputs.key_bucket == (4, 512, 1024)
    assert inputs.offsets.flatten().tolist() == [0, 5 * 32, 305 * 32, 306 * 32, 306 * 32]
    assert inputs.seq_q.flatten().tolist() == [5, 300, 1, 0]
    assert inputs.seq_kv.flatten().tolist() == [5, 1000, 70, 0]
    table = inputs.table.view(4, 1024)
    assert torch.equal(table[:3, :63], tables[2:].int()) and not table[:, 63:].any() and not table[3].any()
    assert inputs.table.shape == (4, 1, 1024, 1) and inputs.table.dtype == torch.int32


def test_a_long_context_takes_a_larger_page_bucket():
    meta = _meta([2048], [30000], torch.zeros(1, 1875, dtype=torch.int64))
    assert C.step_inputs(meta, 32, 128, 16, torch.device("cpu")).key_bucket == (1, 2048, 4096)
