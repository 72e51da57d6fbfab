"""Llama / Mistral / Qwen2 on the op set: fused QKV and gate|up projections, paged attention.

The weights are plain tensors (no nn.Module): the runner owns the step's inputs, the op set does the work,
GEMMs go through torch (cuBLAS on GPU). Logits are computed only for the rows that are sampled.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mii_async.kernels.metadata import AttentionMetadata

from ..loader import ModelSpec, WeightReader
from .rope import cos_sin_cache, inv_frequencies


@dataclass
class LayerWeights:
    input_norm: torch.Tensor          # [H]
    qkv: torch.Tensor                 # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None     # [(Hq + 2 Hkv) D]
    o: torch.Tensor                   # [H, Hq D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor           # [H]
    gate_up: torch.Tensor             # [2 F, H]
    down: torch.Tensor                # [H, F]


class LlamaModel:
    def __init__(self, spec: ModelSpec, layers: list[LayerWeights], embed: torch.Tensor, norm: torch.Tensor,
                 lm_head: torch.Tensor, cos_sin: torch.Tensor, ops: ModuleType) -> None:
        self.spec = spec
        self.layers = layers
        self.embed = embed            # [V, H]
        self.norm = norm              # [H]
        self.lm_head = lm_head        # [V, H] (the embedding when tied)
        self.cos_sin = cos_sin        # [max_pos, D] fp32
        self.ops = ops
        self.scale = spec.head_dim ** -0.5

    @classmethod
    def load(cls, spec: ModelSpec, reader: WeightReader, dtype: torch.dtype, device: torch.device,
             max_positions: int, ops: ModuleType) -> LlamaModel:
        def get(name: str) -> torch.Tensor:
            return reader.get(name).to(device=device, dtype=dtype)

        def opt(name: str) -> torch.Tensor | None:
            return get(name) if name in reader else None

        def cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
            return None if any(t is None for t in ts) else torch.cat(ts, 0)  # type: ignore[arg-type]

        layers = []
        for i in tqdm(range(spec.num_layers), desc="mii_async: loading layers", unit="layer", leave=False):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layers.append(LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")], 0),
                qkv_bias=cat(opt(a + "q_proj.bias"), opt(a + "k_proj.bias"), opt(a + "v_proj.bias")),
                o=get(a + "o_proj.weight"),
                o_bias=opt(a + "o_proj.bias"),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")], 0),
                down=get(m + "down_proj.weight"),
            ))
        embed = get("model.embed_tokens.weight")
        lm_head = embed if spec.tie_word_embeddings or "lm_head.weight" not in reader else get("lm_head.weight")
        inv = inv_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        return cls(spec, layers, embed, get("model.norm.weight"), lm_head,
                   cos_sin_cache(inv, max_positions, device), ops)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, sample_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] → logits [len(sample_rows), V] fp32."""
        ops, spec = self.ops, self.spec
        t = input_ids.shape[0]
        hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        h = self.embed[input_ids]                                            # [T, H]
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual, x = h, ops.rms_norm(h, layer.input_norm, spec.rms_norm_eps)
            else:
                x, residual = ops.fused_add_rms_norm(h, residual, layer.input_norm, spec.rms_norm_eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)                    # [T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
            q, k = ops.rotary_embedding(positions, q.view(t, hq, d), k.view(t, hkv, d), self.cos_sin)
            ops.write_kv(k, v.view(t, hkv, d), k_cache, v_cache, meta.slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
            h = F.linear(attn.reshape(t, hq * d), layer.o, layer.o_bias)
            x, residual = ops.fused_add_rms_norm(h, residual, layer.post_norm, spec.rms_norm_eps)
            h = F.linear(ops.silu_and_mul(F.linear(x, layer.gate_up)), layer.down)
        h, _ = ops.fused_add_rms_norm(h[sample_rows], residual[sample_rows], self.norm, spec.rms_norm_eps)
        return F.linear(h, self.lm_head).float()                             # [S, V]
