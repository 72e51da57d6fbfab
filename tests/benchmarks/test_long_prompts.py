"""The long-prompt benchmark's floors: K/V bytes a token caches, and the bytes a load's decode steps read."""
from __future__ import annotations

from types import SimpleNamespace

from benchmarks.long_prompts import attention_flops, decode_kv_bytes, kv_token_bytes

LLAMA_8B = SimpleNamespace(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)


def test_a_llama_8b_token_caches_128_kib_in_bf16_and_half_in_fp8():
    assert kv_token_bytes(LLAMA_8B, 2) == 128 * 1024
    assert kv_token_bytes(LLAMA_8B, 1) == 64 * 1024
    assert kv_token_bytes(SimpleNamespace(**vars(LLAMA_8B), head_dim=256), 2) == 256 * 1024


def test_decode_reads_every_earlier_token_once_a_step():
    # A prompt of 3 tokens and 4 outputs: tokens 1, 2, 3 are decoded over 4, 5 and 6 cached tokens.
    assert decode_kv_bytes([3], 4, 10) == 10 * (4 + 5 + 6)
    assert decode_kv_bytes([3, 100], 1, 10) == 0
    brute = sum(p + j for p in (5, 9) for j in range(1, 7))
    assert decode_kv_bytes([5, 9], 7, 1) == brute


def test_attention_flops_count_each_query_over_its_causal_context():
    per_pair = 4 * 32 * 32 * 128
    assert attention_flops(LLAMA_8B, 0, 3) == per_pair * (1 + 2 + 3)
    assert attention_flops(LLAMA_8B, 10, 2) == per_pair * (11 + 12)
