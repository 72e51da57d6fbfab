"""The long-context parity probe (benchmarks/long_prompts.long_parity) on the CPU: a tiny Llama-3-rope model in
fp32 over prompts several chunks long, against transformers on the same weights."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from benchmarks.long_prompts import long_parity  # noqa: E402
from tests.workers.helpers import make_engine  # noqa: E402


def test_long_parity_agrees_with_transformers_over_chunked_prompts(tiny_model):
    path = tiny_model("llama3")
    engine = make_engine(path, device="cpu", dtype="float32", max_batch_tokens=128, enable_prefix_caching=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = long_parity(engine, hf, lengths=(300, 700), new=12, ids=(3, 320))
    assert set(out) == {"300", "700"}
    for n, r in out.items():
        assert r["of"] == 12
        assert r["greedy_tokens_before_divergence"] == 12, (n, r)
        assert r["logits_rel_err"] < 1e-4, (n, r)
    assert engine.block_manager.num_free == engine.num_blocks, "KV blocks leaked"
