"""The CPU's int4 weights (quantization="int4"): a tiny random Llama against transformers running the very
weights our quantizer holds (greedy tokens and logits), in fp32 and in int4's default bf16, through the torch
reference and through the CPU op set; TP=2 equals TP=1; the default model's GGUF served at 4 bits by default,
still answering the capital question; refusals."""
from __future__ import annotations

import os

import pytest
import torch

from mii_async.errors import InvalidParameterError
from mii_async.kernels import cpu_build
from mii_async.kernels.int_weight import Int4Weight, Int8Weight, quantize_int4, quantize_int8

from ..helpers import make_engine, run_engine
from .family_parity import greedy
from .test_fp8_models import PROMPTS, _run, check_against, float_tensors, last_logits, rel, save_like, tiny_llama

NEW = 16
OPTIONS = dict(device="cpu", num_blocks=64, block_size=16, max_batch_tokens=32, max_num_seqs=8)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int4_reference(src, out):
    """`src` with every projection as int4 holds it (quantized by rows of the checkpoint tensor: the groups run
    along a row, so q|k|v fused or not gives the same values) and the head as int8 rows, in fp32."""
    tensors = float_tensors(src)
    for name, t in tensors.items():
        if any(f".{p}." in name for p in PROJECTIONS):
            tensors[name] = quantize_int4(t, torch.float32).dequantize(torch.float32)
        elif name == "lm_head.weight":
            tensors[name] = quantize_int8(t, torch.float32).dequantize(torch.float32)
    return save_like(src, tensors, out)


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_int4_in_fp32_matches_transformers_on_its_weights(tmp_path, kernels):
    """int4 with fp32 activations, on the torch reference and on the CPU op set (auto: native where a compiler
    builds it): transformers' logits (1e-4) and greedy tokens on the dequantized weights."""
    src = tiny_llama(tmp_path / "float", hidden=64, ffn=128)
    engine = make_engine(src, quantization="int4", dtype="float32", kernels=kernels, **OPTIONS)
    native = cpu_build.compiler() is not None and os.environ.get(cpu_build.ENV_DISABLE) != "0"
    assert engine.kernels == ("cpu" if kernels == "auto" and native else "reference")
    layer = engine.model.layers[0]
    assert all(isinstance(t, Int4Weight) for t in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down))
    assert isinstance(engine.model.output.weight, Int8Weight)
    check_against(engine, int4_reference(src, tmp_path / "deq"))


def test_int4_defaults_to_bf16_and_stays_near_its_weights(tmp_path):
    """int4 alone runs bf16 activations (its GEMMs' fast path): logits within bf16's reach of transformers' fp32
    on the same weights, and near the float model's."""
    src = tiny_llama(tmp_path / "float", hidden=64, ffn=128)
    engine = make_engine(src, quantization="int4", **OPTIONS)
    assert engine.dtype == torch.bfloat16
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(int4_reference(src, tmp_path / "deq")), dtype=torch.float32)
    logits = last_logits(engine, PROMPTS[1]).float()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPTS[1]])).logits[0, -1]
    assert rel(logits, want) < 2e-2
    drift = rel(logits, last_logits(make_engine(src, dtype="float32", **OPTIONS), PROMPTS[1]))
    assert 0 < drift < 0.3, f"int4 logits {drift:.3f} from the float model's"
    outs = run_engine(engine, PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW)
    agree = sum(o == greedy(ref, p, NEW) for p, o in zip(PROMPTS, outs))
    assert agree >= len(PROMPTS) // 2, f"{agree}/{len(PROMPTS)} greedy continuations equal transformers'"


@pytest.mark.slow
def test_int4_tp2_equals_tp1(tmp_path):
    """TP=2 (gloo) on int4 weights: each rank quantizes its rows, and its columns on group edges."""
    src = tiny_llama(tmp_path / "float", hidden=256, ffn=512)
    one = _run(src, 1, tmp_path, quantization="int4", dtype="float32")
    two = _run(src, 2, tmp_path, quantization="int4", dtype="float32")
    assert rel(torch.tensor(two["logits"]), torch.tensor(one["logits"])) < 1e-4
    assert one["greedy"] == two["greedy"]


def test_int4_refusals(tmp_path):
    """int4 is the CPU's: refused on a GPU, on a checkpoint already quantized, and where a tensor-parallel
    split would cut an int4 group — each naming its parameter."""
    src = tiny_llama(tmp_path / "float", hidden=64, ffn=128)
    with pytest.raises(InvalidParameterError, match="quantization"):
        make_engine(src, quantization="int4", **{**OPTIONS, "device": "cuda"})
    with pytest.raises(InvalidParameterError, match="quantization"):
        make_engine(src, quantization="int8", **OPTIONS)


def test_default_model_serves_its_gguf_at_4_bits(tmp_path, caplog):
    """No model, dtype or quantization named: the default model's Q4_1 file is served as int4 with bf16
    activations, the start's plan says so, and the chat answer to the capital question is unchanged."""
    import logging

    import mii_async

    with caplog.at_level(logging.INFO, logger="mii_async.workers.engine"):
        with mii_async.pipeline(device="cpu") as pipe:
            r = pipe.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=32)
    assert r.generated_text == "The capital of France is Paris."
    plan = [m for m in caplog.messages if m.startswith("cpu plan:")]
    assert plan and "int4" in plan[0] and "Q4_1" in plan[0] and "bfloat16 activations" in plan[0], plan


def test_a_named_dtype_keeps_the_full_precision_path(default_model_dir, caplog):
    """dtype named (or an HF directory given): no automatic int4 — the converted fp32 weights, as before."""
    import logging

    with caplog.at_level(logging.INFO, logger="mii_async.workers.engine"):
        engine = make_engine(default_model_dir, device="cpu", num_blocks=8)
    assert engine.dtype == torch.float32
    assert not isinstance(engine.model.layers[0].mlp.down, Int4Weight)
    assert any("cpu plan: float32 weights" in m for m in caplog.messages)
