"""AttentionMetadata: where a step's tokens sit in the blocked KV cache.

Built once per step by the runner and shared by every layer. Sequences are ordered decodes first: the first
`num_decodes` sequences have exactly one query token each (decode, or a one-token prefill chunk), so their
tokens are rows [0, num_decodes) of the step.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class AttentionMetadata(NamedTuple):
    slot_mapping: torch.Tensor      # [num_tokens] int64: block_id * block_size + offset where each token's K/V goes
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int64: each sequence's blocks, padded with 0
    context_lens: torch.Tensor      # [num_seqs] int64: keys per sequence after this step's tokens are written
    query_start_loc: torch.Tensor   # [num_seqs + 1] int64: prefix sums of query lengths
    num_decodes: int                # leading sequences with one query token
    max_context_len: int            # max(context_lens)
    query_lens: list[int]           # host copy of the query lengths (the reference loops over prefills)
    context_lens_host: list[int]    # host copy of context_lens
