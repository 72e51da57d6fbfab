"""kv_cache_dtype="fp8": K and V cached as e4m3 (the reference ops; CPU here): the pool holds twice bf16's tokens
(four times fp32's) in the same memory, the last prompt position's logits stay within 10% of the model-dtype
cache's (3–5% on the tiny model; a broken cache is ~100% away), a bad value is refused naming the option, and
the kv store saturates instead of overflowing."""
from __future__ import annotations

import pytest
import torch

from mii_async.config import CacheConfig, EngineConfig
from mii_async.errors import InvalidParameterError
from mii_async.kernels import kv_store
from mii_async.params import SamplingParams

from .helpers import make_engine, run_engine


def _last_logits(engine, prompt: list[int]) -> torch.Tensor:
    engine.add_request(1, prompt, SamplingParams(max_new_tokens=1))
    logits = None
    while logits is None:                       # the prompt's chunks; the last one samples
        plan = engine.scheduler.schedule()
        out = engine.runner.execute(plan)
        seq = engine.seqs[1]
        engine.scheduler.commit(seq, len(plan.seqs[0].token_ids))
        if plan.seqs[0].sample:
            logits = out[0].float().clone()
    engine.abort(1)
    return logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_cache_close_to_the_model_dtype_cache(tiny_model, dtype):
    path = tiny_model("llama")
    base = make_engine(path, dtype=dtype, kv_cache_memory=0.01, max_batch_tokens=64)
    fp8 = make_engine(path, dtype=dtype, kv_cache_memory=0.01, max_batch_tokens=64, kv_cache_dtype="fp8")
    assert fp8.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    ratio = torch.tensor([], dtype=getattr(torch, dtype)).element_size()       # 4 (fp32) or 2 (bf16)
    assert abs(fp8.num_blocks - ratio * base.num_blocks) <= ratio               # the same GiB, floored
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(40 + 30 * i)] for i in range(4)]
    for p in prompts:                            # chunked prompts: later chunks read the fp8 K/V of earlier ones
        a, b = _last_logits(base, p), _last_logits(fp8, p)
        assert torch.linalg.norm(b - a) / torch.linalg.norm(a) < 0.1
        assert not torch.equal(a, b)              # the K/V really went through e4m3
    # Batched decoding over the fp8 blocks: every sequence to its length, no block leaked (run_engine checks).
    assert [len(o) for o in run_engine(fp8, prompts, max_new_tokens=16, min_new_tokens=16)] == [16] * 4


def test_the_option_is_checked_and_routed():
    assert EngineConfig.from_kwargs("m", kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8"
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    with pytest.raises(InvalidParameterError) as e:
        CacheConfig(kv_cache_dtype="int8")
    assert e.value.param == "kv_cache_dtype"


def test_the_store_saturates_and_round_trips():
    cache = torch.zeros(3, 4, 2, 8, dtype=torch.float8_e4m3fn)
    x = torch.randn(5, 2, 8) * 10
    x[0, 0, 0], x[1, 1, 1] = 1e4, -1e4
    slots = torch.tensor([0, 3, 4, 9, 11])
    kv_store.store(cache, slots, x)
    back = kv_store.select_blocks(cache, torch.tensor([0, 1, 2])).view(12, 2, 8)[slots].float()
    assert back[0, 0, 0] == 448 and back[1, 1, 1] == -448
    x = x.clamp(-448, 448)
    assert torch.all((back - x).abs() <= x.abs() / 8 + 2 ** -9)      # e4m3: 3 mantissa bits
