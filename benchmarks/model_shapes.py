"""The real-size model shapes of the single-GPU benchmarks (benchmarks/llama8b.py `--shape`): transformers' config
and model class of each, with random weights, and what a step of each must read and compute — the floors.

    llama3-8b       Llama-3-8B (the default)
    llama3.1-8b     Llama-3.1-8B: the same weights' shape, llama3 rope scaling to 131,072 positions; served with a
                    32,768-token context (the long-prompt loads)
    qwen3-8b        Qwen3-8B: q/k norms, no qkv bias
    gemma2-9b       Gemma-2-9B: (1 + w) norms before and after each block, GeGLU, 4,096-token windows on every
                    other layer, attention and final soft-caps, tied embeddings
    gemma3-12b      Gemma-3-12B (text): 1,024-token windows on five layers in six, per-layer rope bases, tied
    phi4-mini       Phi-4-mini: fused qkv and gate|up, LongRoPE over 3/4 of each head, tied embeddings; served
                    with a 4,096-token context, where LongRoPE's short frequencies are transformers' too
    qwen3-30b-a3b   Qwen3-30B-A3B: 128 experts, 8 a token (renormalised), 3.3B of 30.5B parameters active

The floors count what a decode step reads and a token computes: every weight once, less the embedding table
(a token reads one row of it; a tied table is read once, as the LM head) and, in a mixture of experts, less the
experts a token does not choose (at batch 1 a step reads the k chosen experts of each layer); FLOPs are two per
weight a token multiplies (embedding lookups excluded, the LM head included).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    config: str                          # transformers config class
    model: str                           # transformers model class
    kwargs: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)     # our engine's options for it

    def build_config(self) -> Any:
        import transformers

        return getattr(transformers, self.config)(**self.kwargs, initializer_range=0.02)

    @property
    def moe(self) -> bool:
        return "num_experts" in self.kwargs or "num_local_experts" in self.kwargs


LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)

SHAPES: dict[str, Shape] = {
    "llama3-8b": Shape("LlamaConfig", "LlamaForCausalLM", LLAMA3_8B),
    "llama3.1-8b": Shape("LlamaConfig", "LlamaForCausalLM", {
        **LLAMA3_8B, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
        engine={"max_model_len": 32768}),
    "qwen3-8b": Shape("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False)),
    "gemma2-9b": Shape("Gemma2Config", "Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192,
        rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)),
    "gemma3-12b": Shape("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        max_position_embeddings=131072, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        tie_word_embeddings=True)),
    "phi4-mini": Shape("Phi3Config", "Phi3ForCausalLM", dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.02 * i for i in range(48)],
                         "long_factor": [1.0 + 0.5 * i for i in range(48)]},
        rms_norm_eps=1e-5, bos_token_id=199999, eos_token_id=199999, pad_token_id=199999,
        tie_word_embeddings=True),
        # LongRoPE's short set, as transformers rotates sequences within the original context (rope.py's
        # docstring: the engine's set follows its context)
        engine={"max_model_len": 4096}),
    "qwen3-30b-a3b": Shape("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=False)),
}


def build_hf(name: str, seed: int = 0) -> tuple[Any, Any]:
    """(config, transformers' model of `name` with random bf16 weights on the GPU). Built in bf16 the way
    from_pretrained builds it: `.to(torch.bfloat16)` after the fact would also round the rotary inv_freq buffer
    to bf16, and every position's angle with it."""
    import transformers

    shape = SHAPES[name]
    torch.manual_seed(seed)
    cfg = shape.build_config()
    with torch.device("cuda"):
        hf = getattr(transformers, shape.model)._from_config(cfg, dtype=torch.bfloat16).eval()
    return cfg, hf


def checkpoint_tensors(hf: Any) -> dict[str, torch.Tensor]:
    """The model's tensors under a checkpoint's names. transformers keeps a mixture's experts fused in memory
    (`experts.gate_up_proj` [E, 2F, H] with the gate rows first, `experts.down_proj` [E, H, F]) and writes them per
    expert; the per-expert tensors here are views of the fused ones (no copy)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in hf.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            base, f = k[:-len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :f]
                out[f"{base}{e}.up_proj.weight"] = v[e, f:]
        elif k.endswith("experts.down_proj"):
            base = k[:-len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def active_weights(hf: Any) -> int:
    """Weights a token multiplies in transformers' model: all of them, less the embedding table unless tied (then
    it is the LM head), less the experts a token does not choose (k of E in each layer)."""
    cfg = hf.config
    total = sum(p.numel() for p in hf.parameters())      # a tied table is one parameter
    if not getattr(cfg, "tie_word_embeddings", False):
        total -= cfg.vocab_size * cfg.hidden_size
    experts = getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0)
    if experts:
        f = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        total -= (experts - cfg.num_experts_per_tok) * 3 * f * cfg.hidden_size * cfg.num_hidden_layers
    return total


def step_bytes(hf: Any) -> int:
    """Bytes a batch-1 decode step must read in bf16: each weight it multiplies, once."""
    return 2 * active_weights(hf)


def token_flops(hf: Any) -> int:
    """FLOPs of a token: two per weight it multiplies (attention's own FLOPs left out: short contexts)."""
    return 2 * active_weights(hf)
