"""The benchmark shapes' bookkeeping on the CPU: a mixture's fused experts handed over under the names
transformers writes (so the engine loads them as it loads a checkpoint), and the weights a token multiplies."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from benchmarks.model_shapes import SHAPES, active_weights, checkpoint_tensors


def test_checkpoint_tensors_are_the_saved_checkpoint(tmp_path):
    """A tiny Qwen3-MoE: checkpoint_tensors gives every tensor save_pretrained writes, under its name, equal."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(str(tmp_path))
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    ours = checkpoint_tensors(model)
    assert set(ours) == set(saved)
    for name, t in saved.items():
        assert torch.equal(ours[name], t), name


def test_active_weights_count_what_a_token_multiplies():
    """Llama-3-8B: 8.03B weights, 7.50B without the (untied) embedding table; Qwen3-30B-A3B: 8 of 128 experts."""
    import transformers

    def on_meta(name):
        shape = SHAPES[name]
        with torch.device("meta"):
            return getattr(transformers, shape.model)._from_config(shape.build_config(), dtype=torch.bfloat16)

    llama = on_meta("llama3-8b")
    total = sum(p.numel() for p in llama.parameters())
    assert total - active_weights(llama) == 128256 * 4096
    moe = on_meta("qwen3-30b-a3b")
    total = sum(p.numel() for p in moe.parameters())
    assert total - active_weights(moe) == 151936 * 2048 + 48 * 120 * 3 * 768 * 2048
