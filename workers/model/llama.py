"""Llama / Mistral / Qwen2 on the op set: fused QKV and gate|up projections, paged attention.

The weights are plain tensors (no nn.Module): the runner owns the step's inputs, the op set does the work,
projections included (cuBLAS through torch; on CUDA, gemv.cu for a few rows, with the norm before a
projection as its prologue and SiLU-and-mul as gate|up's epilogue). Logits are computed only for the rows
that are sampled.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from tqdm.auto import tqdm

from mii_async.kernels.metadata import AttentionMetadata

from .loader import ModelSpec, WeightReader
from .parallel import TPGroup
from .shard_plan import ShardPlan, shard_plan
from .rope import attention_factor, cos_sin_cache, inv_frequencies

log = logging.getLogger("mii_async.workers.model.loader")


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
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads   # this rank's, under TP
        self.tp: TPGroup | None = None
        self.shard: ShardPlan | None = None

    @classmethod
    def load(cls, spec: ModelSpec, reader: WeightReader, dtype: torch.dtype, device: torch.device,
             max_positions: int, ops: ModuleType, tp: TPGroup | None = None) -> LlamaModel:
        """Loads the model, or with `tp` this rank's shard of it (reading only its slices from the files)."""
        shard = shard_plan(spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size,
                           tp.rank, tp.world) if tp is not None else None
        d = spec.head_dim

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)

        def get(name: str, dim: int | None = None, span: tuple[int, int] | None = None, scale: int = 1) -> torch.Tensor:
            if shard is None or dim is None or span is None:
                return put(reader.get(name))
            return put(reader.get_slice(name, dim, span[0] * scale, span[1] * scale))

        def opt(name: str, *args: Any) -> torch.Tensor | None:
            return get(name, *args) if name in reader else None

        def cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
            return None if any(t is None for t in ts) else torch.cat(ts, 0)  # type: ignore[arg-type]

        q, kv, ffn = (shard.q_heads, shard.kv_heads, shard.ffn) if shard else (None, None, None)
        layers = []
        for i in tqdm(range(spec.num_layers), desc="mii_async: loading layers", unit="layer", leave=False):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            o_bias = opt(a + "o_proj.bias") if shard is None or shard.rank == 0 else None   # added once
            layers.append(LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=torch.cat([get(a + "q_proj.weight", 0, q, d), get(a + "k_proj.weight", 0, kv, d),
                               get(a + "v_proj.weight", 0, kv, d)], 0),
                qkv_bias=cat(opt(a + "q_proj.bias", 0, q, d), opt(a + "k_proj.bias", 0, kv, d),
                             opt(a + "v_proj.bias", 0, kv, d)),
                o=get(a + "o_proj.weight", 1, q, d),
                o_bias=o_bias,
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([get(m + "gate_proj.weight", 0, ffn), get(m + "up_proj.weight", 0, ffn)], 0),
                down=get(m + "down_proj.weight", 1, ffn),
            ))
        vocab = shard.vocab if shard else None
        embed = get("model.embed_tokens.weight", 0, vocab)
        tied = spec.tie_word_embeddings or "lm_head.weight" not in reader
        if tied and not spec.tie_word_embeddings:   # transformers would start a random head here
            log.warning("the checkpoint has no lm_head.weight though tie_word_embeddings is false: the output "
                        "head is the input embedding")
        lm_head = embed if tied else get("lm_head.weight", 0, vocab)
        if shard is not None and lm_head.shape[0] < shard.vocab_per_rank:   # the last rank's rows, padded
            lm_head = torch.cat([lm_head, lm_head.new_zeros(shard.vocab_per_rank - lm_head.shape[0], lm_head.shape[1])])
        inv = inv_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        cos_sin = cos_sin_cache(inv, max_positions, device, attention_factor(spec.rope_scaling))
        model = cls(spec, layers, embed, get("model.norm.weight"), lm_head, cos_sin, ops)
        model.tp, model.shard = tp, shard
        if shard is not None:
            model.num_heads, model.num_kv_heads = shard.num_q_heads, shard.num_kv_heads
        return model

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, sample_rows: torch.Tensor,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """input_ids, positions [T] → logits [len(sample_rows), V] fp32. `between_layers()` runs on the host
        after each layer's kernels are enqueued (the engine reads the step in flight there)."""
        t = input_ids.shape[0]
        h = self.embed_tokens(input_ids)                                           # [T, H]
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            q, residual = self.pre_attention(layer, h, residual, positions, meta.slot_mapping, k_cache, v_cache)
            attn = self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
            h, residual = self.post_attention(layer, attn.reshape(t, -1), residual)
            if between_layers is not None:
                between_layers()
        assert residual is not None
        return self.head(h, residual, sample_rows)

    # A layer in two parts around its attention: the parts a piecewise CUDA graph holds (piecewise_graphs.py).
    def pre_attention(self, layer: LayerWeights, h: torch.Tensor, residual: torch.Tensor | None,
                      positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual +) norm, QKV, rotary, and this step's K/V written to the cache → q [T, Hq, D], residual."""
        ops, spec = self.ops, self.spec
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, spec.head_dim
        # The norms ride on the projections after them, SiLU-and-mul on gate|up (at small batches, one kernel
        # each).
        qkv, residual = ops.add_rms_norm_linear(h, residual, layer.input_norm, spec.rms_norm_eps, layer.qkv,
                                                layer.qkv_bias)                      # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
        q = ops.rotary_write_kv(positions, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d),
                                self.cos_sin, k_cache, v_cache, slot_mapping)
        return q, residual

    def post_attention(self, layer: LayerWeights, attn: torch.Tensor,
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [T, Hq·D] → o_proj, residual + norm, the MLP → h [T, H], residual."""
        ops, tp = self.ops, self.tp
        h = ops.linear(attn, layer.o, layer.o_bias)
        if tp is not None:
            tp.all_reduce(h)                                                 # row-parallel o_proj
        act, residual = ops.add_rms_norm_gate_up(h, residual, layer.post_norm, self.spec.rms_norm_eps, layer.gate_up)
        h = ops.linear(act, layer.down)                                      # act = silu(gate) * up [T, F]
        if tp is not None:
            tp.all_reduce(h)                                                 # row-parallel down
        return h, residual

    def head(self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head, on `rows` only → logits [len(rows), V] fp32."""
        tp = self.tp
        logits, _ = self.ops.add_rms_norm_linear(h[rows], residual[rows], self.norm, self.spec.rms_norm_eps,
                                                 self.lm_head, out_dtype=torch.float32 if tp is None else None)
        if tp is not None:                                                   # [S, V] (or [S, ceil(V/T)])
            logits = tp.all_gather_last(logits)[:, :self.spec.vocab_size].float()  # vocab-parallel lm_head
        return logits

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return self.embed[input_ids]
        lo, hi = self.shard.vocab                                            # vocab-parallel: mask, then sum
        local = input_ids - lo
        inside = (local >= 0) & (local < hi - lo)
        h = self.embed[local.clamp(0, hi - lo - 1)] * inside.unsqueeze(-1).to(self.embed.dtype)
        assert self.tp is not None
        return self.tp.all_reduce(h)
