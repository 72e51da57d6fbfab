"""Sliding-window attention in the paged KV cache: Mistral and Qwen2 windows honoured (not a cap on the
context) against transformers, one block table for windowed and global layers, no block freed early, an
architecture file that would ignore a window refused; on the GPU, every family with windows, soft-caps, q/k
norms and partial rotary through the CUDA kernels and graphs."""
from __future__ import annotations

import pytest
import torch

from mii_async.errors import UnsupportedModelError
from mii_async.params import SamplingParams

from ..helpers import make_engine
from .family_parity import SHAPE, check_parity, hf_reference, prompts_for, save_tiny


def _mistral(tmp_path, window: int = 24):
    from transformers import MistralConfig, MistralForCausalLM

    return save_tiny(MistralForCausalLM, MistralConfig(**{**SHAPE, "num_hidden_layers": 2}, sliding_window=window),
                     tmp_path / "mistral")


def test_mistral_window_is_honoured_not_a_cap(tmp_path):
    """Mistral with a 24-token window: the engine's context stays the model's 256 positions, and prompts of
    40–100 tokens give transformers' greedy tokens and logits (every layer attends to its last 24 positions)."""
    path = _mistral(tmp_path)
    engine = make_engine(path, num_blocks=64, block_size=16)
    assert engine.max_model_len == 256
    check_parity(path, prompts_for("mistral-window", [40, 100, 63, 88]))


def test_qwen2_windows_only_in_its_sliding_layers(tmp_path):
    """Qwen2 with use_sliding_window and max_window_layers 1: layer 0 attends to everything, layer 1 to its
    last 24 positions, both over one block table: transformers' tokens and logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**SHAPE, "num_hidden_layers": 2}, use_sliding_window=True, sliding_window=24,
                         max_window_layers=1)
    path = save_tiny(Qwen2ForCausalLM, config, tmp_path / "qwen2")
    check_parity(path, prompts_for("qwen2-window", [40, 100, 63]))


def test_blocks_out_of_the_window_stay_allocated(tmp_path):
    """A sequence far past the window keeps every block it wrote until it finishes (none is freed early), and
    then all are returned."""
    path = _mistral(tmp_path, window=16)
    engine = make_engine(path, num_blocks=64, block_size=16)
    engine.add_request(7, list(range(3, 83)), SamplingParams(max_new_tokens=40, ignore_eos=True))
    seen = 0
    while engine.has_work():
        engine.step()
        seq = engine.seqs.get(7)
        if seq is not None and seq.num_computed_tokens:
            assert len(seq.block_table) == -(-seq.num_computed_tokens // 16)
            assert engine.block_manager.num_free == engine.num_blocks - len(seq.block_table)
            seen += 1
    assert seen > 10
    assert engine.block_manager.num_free == engine.num_blocks


def test_an_architecture_that_ignores_the_window_is_refused(tmp_path):
    """A model file whose layers would attend densely under a config's sliding_window is refused at load,
    naming sliding_window, rather than run wrongly."""
    from mii_async.kernels import get_ops
    from mii_async.workers.model.layers.attention import Attention
    from mii_async.workers.model.llama import LlamaModel
    from mii_async.workers.model.loader import WeightReader, load_spec

    class Dense(LlamaModel):
        @classmethod
        def load_layer(cls, w, spec, index, cos_sin, tp):
            layer = super().load_layer(w, spec, index, cos_sin, tp)
            layer.attn = Attention(**{**layer.attn.__dict__, "window": None})
            return layer

    path = _mistral(tmp_path)
    spec = load_spec(path)
    with pytest.raises(UnsupportedModelError, match="sliding_window 24"):
        Dense.load(spec, WeightReader(path), torch.float32, torch.device("cpu"), 256, get_ops("reference"))
    assert LlamaModel.load(spec, WeightReader(path), torch.float32, torch.device("cpu"), 256,
                           get_ops("reference")).layers[1].attn.window == 24


# -- on the GPU: the CUDA kernels (head dim 128, which they take) and graphs --------------------------------
GPU_SHAPE = {**SHAPE, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 2048}


def _gpu_model(tmp_path, family: str):
    import transformers as tf

    layers = {"num_hidden_layers": 3}
    if family == "qwen3":
        cfg = tf.Qwen3Config(**GPU_SHAPE, **layers, use_sliding_window=True, sliding_window=100, max_window_layers=1)
        cls = tf.Qwen3ForCausalLM
    elif family == "gemma2":
        cfg = tf.Gemma2Config(**GPU_SHAPE, **layers, sliding_window=100, query_pre_attn_scalar=96,
                              attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
        cls = tf.Gemma2ForCausalLM
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(**GPU_SHAPE, **layers, sliding_window=100, query_pre_attn_scalar=128,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        cls = tf.Gemma3ForCausalLM
    else:
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.05 * i for i in range(48)], "long_factor": [1.5 + 0.1 * i for i in range(48)]}
        cfg = tf.Phi3Config(**GPU_SHAPE, **layers, sliding_window=100, rope_parameters=rope,
                            original_max_position_embeddings=256)
        cls = tf.Phi3ForCausalLM
    return save_tiny(cls, cfg, tmp_path / family, noise=0.05)


FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_families_on_cuda_fp32_match_transformers(tmp_path, family):
    """fp32 on the GPU with the CUDA op set and its graphs (the split decode kernel, SDPA per sequence, the
    capped fp32 path): prompts of 300–600 tokens past a 100-token window, greedy tokens and logits equal to
    transformers' in fp32 on the CPU. (transformers' own forward on an H100 chose other tokens than its CPU
    forward for the windowed Qwen3 and Phi-3 where the top two logits were 0.08–0.14 apart in fp64; ours chose
    the fp64 forward's.)"""
    path = _gpu_model(tmp_path, family)
    check_parity(path, prompts_for(f"{family}-gpu", [300, 600, 450]), tol=1e-3, device="cuda", ref_device="cpu",
                 dtype="float32", kernels="cuda", num_blocks=512, max_batch_tokens=256, max_num_seqs=8)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_families_on_cuda_bf16_logits(tmp_path, family):
    """bf16 with the CUDA op set (variable-length flash within the window, the tensor-core decode kernel with
    the window and the cap, replayed from the decode graphs): the logits of the prefill's last chunk and of 8
    decode steps after a 500-token prompt, each against transformers' fp32 forward over the same tokens, within
    3e-2 or 1.25× the error of transformers' own bf16 forward, whichever is larger (bf16 rounding alone moves
    Phi-3's partial-rotary LongRoPE logits by ~8e-2)."""
    from ..helpers import run_engine

    path = _gpu_model(tmp_path, family)
    hf = hf_reference(path, device="cuda")
    engine = make_engine(path, device="cuda", dtype="bfloat16", kernels="cuda", num_blocks=256,
                         max_batch_tokens=128, async_scheduling=False)
    assert engine.runner.graphs is not None
    steps: list[torch.Tensor] = []
    execute = engine.runner.execute

    def record(plan, *args, **kwargs):             # a probe: each step's logits, copied before the next replay
        logits = execute(plan, *args, **kwargs)
        if plan.seqs[0].sample:
            steps.append(logits[0].float().clone())
        return logits

    engine.runner.execute = record
    prompt = prompts_for(f"{family}-bf16", [500])[0]
    out = run_engine(engine, [prompt], max_new_tokens=9, min_new_tokens=9)[0]
    assert engine.runner.graphs.replays >= 8
    hf16 = hf_reference(path, dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([prompt + out[:-1]], device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits[0, len(prompt) - 1:]                         # [9, V]
        ref16 = hf16(ids).logits[0, len(prompt) - 1:].float()
    assert len(steps) == 9

    def rel(a, b):
        return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()

    for i, got in enumerate(steps):
        assert rel(got, ref[i]) < max(3e-2, 1.25 * rel(ref16[i], ref[i])), i
