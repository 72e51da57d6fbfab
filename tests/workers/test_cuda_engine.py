"""The same engine code path on CUDA, with the reference ops on the GPU and with the CuPy kernels: parity with
transformers there."""
from __future__ import annotations

import random

import pytest
import torch

import mii_async

from .helpers import make_engine, run_engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kernels", ["reference", "cuda"])
@pytest.mark.parametrize("kind", ["llama", "llama3", "mistral", "qwen2"])
def test_tiny_models_fp32_on_cuda_match_transformers(tiny_model, kind, kernels):
    """fp32 on the GPU, with either op set: greedy outputs equal transformers' on the GPU, same weights."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(kind)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    rng = random.Random(kind)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(5, 90))] for _ in range(4)]
    engine = make_engine(path, device="cuda", dtype="float32", num_blocks=64, kernels=kernels)
    assert engine.kernels == kernels
    ours = run_engine(engine, prompts, max_new_tokens=32, min_new_tokens=32)
    for p, o in zip(prompts, ours):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert o == ref


@pytest.mark.parametrize("kernels", ["reference", "cuda"])
@pytest.mark.parametrize("dtype,tol", [("bfloat16", 2e-2), ("float16", 5e-3)])
def test_half_precision_logits_on_cuda(tiny_model, dtype, tol, kernels):
    """bf16 / fp16 on the GPU: last-position logits of a chunked prefill within tol of transformers' fp32."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama3")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    engine = make_engine(path, device="cuda", dtype=dtype, num_blocks=64, max_batch_tokens=32, kernels=kernels)
    prompt = [random.Random(1).randrange(3, 320) for _ in range(100)]
    engine.add_request(1, prompt, mii_async.SamplingParams(max_new_tokens=1))
    while True:                                    # prefill in 32-token chunks; the last one is sampled
        plan = engine.scheduler.schedule()
        logits = engine.runner.execute(plan)
        if plan.seqs[0].sample:
            break
        engine.scheduler.commit(engine.seqs[1], len(plan.seqs[0].token_ids))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1]
    assert torch.linalg.norm(logits[0] - ref) / torch.linalg.norm(ref) < tol


def test_cuda_kernels_with_real_head_dims_match_transformers(tmp_path):
    """With head dims the decode kernel takes (64, 128) and GQA, the CuPy op set's fp32 greedy outputs equal
    transformers' on the GPU, and its bf16 decode logits stay within 2e-2 of transformers' fp32."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mii_async.kernels.cuda import decode_supported

    for hidden, heads, kv in ((256, 4, 2), (512, 4, 1)):
        assert decode_supported(heads, kv, hidden // heads)
        cfg = LlamaConfig(vocab_size=320, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                          num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
                          initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(hidden)
        path = tmp_path / f"h{hidden}"
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
        rng = random.Random(hidden)
        prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(5, 600))] for _ in range(4)]
        engine = make_engine(path, device="cuda", dtype="float32", num_blocks=256, kernels="cuda")
        ours = run_engine(engine, prompts, max_new_tokens=24, min_new_tokens=24)
        for p, o in zip(prompts, ours):
            ids = torch.tensor([p], device="cuda")
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                              do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            assert o == ref
        engine = make_engine(path, device="cuda", dtype="bfloat16", num_blocks=256, kernels="cuda")
        engine.add_request(1, prompts[0], mii_async.SamplingParams(max_new_tokens=4))
        while not engine.seqs[1].output_ids:          # the prefill, through the engine's own step
            engine.step()
        engine.flush()                                 # its sampled id read (async scheduling)
        plan = engine.scheduler.schedule()             # then one decode step, by hand, to see its logits
        assert plan.num_decodes == 1
        logits = engine.runner.execute(plan)[0]
        full = prompts[0] + [engine.seqs[1].output_ids[0]]
        with torch.no_grad():
            ref = hf(torch.tensor([full], device="cuda")).logits[0, -1]
        assert torch.linalg.norm(logits - ref) / torch.linalg.norm(ref) < 2e-2
