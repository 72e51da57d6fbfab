"""DecoderModel: a decoder-only transformer over the shared blocks (layers/), and what the engine calls on it.

The embedding, L pre-norm layers (attention, then the gated MLP, each adding its input to the residual stream
in the norm of the block after it; Gemma also norms each block's output before it joins the stream), the final
norm and the LM head; logits are computed only for the rows that are sampled. An architecture file subclasses
it, names the config.json architectures it serves, refuses the config fields its layers do not compute, and
loads one layer (`load_layer`); the registry maps the names to the class.

Each layer gets its rotary cache from `load`: the model's, or in a model whose sliding layers have their own rope
base (Gemma 3), theirs. A layer attends within its sliding window (spec.window_of) with the one block table all
layers share; the blocks that fall out of every window stay allocated until the sequence ends.

The runner, the decode graphs and the piecewise graphs (workers/execute/) call `forward`, or a layer at a time
`embed_tokens`, `pre_attention`, `attention`, `post_attention` and `head`, and read `spec`, `layers`, `embed`,
`num_heads`, `num_kv_heads`, `scale` and `ops` (which a probe may replace between runs).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from tqdm.auto import tqdm

from mii_async.errors import UnsupportedModelError
from mii_async.kernels.cpu_decode import FusedLayer
from mii_async.kernels.metadata import AttentionMetadata

from .layers.attention import Attention
from .layers.embedding import Embedding, LMHead
from .layers.mlp import GatedMLP
from .layers.moe import MoE
from .layers.norm import RMSNorm
from .parallel import TPGroup
from .quantization import WeightQuant
from .rope import rotary_cache
from .shard_plan import ShardPlan, shard_plan
from .spec import ModelSpec
from .weights import Weights, WeightSource

if TYPE_CHECKING:
    from mii_async.kernels.op_set import OpSet


@dataclass
class DecoderLayer:
    """Pre-norm: attention, then the MLP, each block's norm adding the stream so far to the residual; with
    post-norms (Gemma) each block's output is normed before it joins the stream."""
    attn: Attention
    mlp: GatedMLP | MoE
    post_attn_norm: RMSNorm | None = None   # on o_proj's output (Gemma's post_attention_layernorm)
    post_mlp_norm: RMSNorm | None = None    # on down's output (Gemma's post_feedforward_layernorm)
    # The previous layer's post_mlp_norm, which this layer applies to its input as its first norm's prologue
    # (that layer then hands its output over un-normed: `defer_post_mlp_norm`).
    input_post_norm: RMSNorm | None = None
    defer_post_mlp_norm: bool = False

    def pre_attention(self, ops: OpSet, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attn.project(ops, h, residual, positions, slot_mapping, k_cache, v_cache,
                                 pre_norm=self.input_post_norm)

    def post_attention(self, ops: OpSet, attn: torch.Tensor,
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, then the MLP; a post-norm on o_proj's output is the MLP's first norm's prologue."""
        h = self.attn.output(ops, attn)
        h, residual = self.mlp(ops, h, residual, pre_norm=self.post_attn_norm)
        if self.post_mlp_norm is not None and not self.defer_post_mlp_norm:
            h = ops.rms_norm(h, self.post_mlp_norm.weight, self.post_mlp_norm.eps)
        return h, residual


class DecoderModel(ABC):
    architectures: ClassVar[tuple[str, ...]] = ()   # config.json `architectures` names this class runs
    model_types: ClassVar[dict[str, str]] = {}      # model_type → its architecture, for configs that name none
    config_defaults: ClassVar[dict[str, Any]] = {}  # config.json fields its transformers config class fills in
                                                    # when absent (loader.py reads them so)
    norm_offset: ClassVar[float] = 0.0              # added to every RMSNorm weight at load (Gemma: 1)

    def __init__(self, spec: ModelSpec, embedding: Embedding, layers: list[DecoderLayer], output: LMHead,
                 ops: OpSet, tp: TPGroup | None, shard: ShardPlan | None) -> None:
        self.spec = spec
        self.embedding = embedding
        self.layers = layers
        self.output = output
        self.ops = ops
        self.tp, self.shard = tp, shard
        self.num_heads, self.num_kv_heads = layers[0].attn.num_heads, layers[0].attn.num_kv_heads  # this rank's
        self.scale = spec.softmax_scale             # the softmax scale of every layer's attention
        self._fused: tuple[Any, Any, Any] | None = None   # (op set's maker, caches, step): _fused_decode's

    @property
    def embed(self) -> torch.Tensor:
        """The embedding table [V, H] (this rank's rows under TP); its dtype is the activations'."""
        return self.embedding.weight

    @property
    def lm_head(self) -> torch.Tensor:
        """The output projection [V, H] (the embedding itself when tied)."""
        return self.output.weight

    # -- what an architecture file says ------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        """Raises UnsupportedModelError, naming the field, for a config.json that this class would load and
        run wrongly. Runs before the spec is read."""

    @classmethod
    def embedding_scale(cls, spec: ModelSpec) -> float | None:
        """What each embedding row is multiplied by (Gemma: sqrt(hidden_size)); None: nothing."""
        return None

    @classmethod
    @abstractmethod
    def load_layer(cls, w: Weights, spec: ModelSpec, index: int, cos_sin: torch.Tensor,
                   tp: TPGroup | None) -> DecoderLayer:
        """Layer `index` from the checkpoint (this rank's slices of it)."""

    # -- loading -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, spec: ModelSpec, reader: WeightSource, dtype: torch.dtype, device: torch.device,
             max_positions: int, ops: OpSet, tp: TPGroup | None = None,
             quant: WeightQuant | None = None) -> DecoderModel:
        """Loads the model, or with `tp` this rank's shard of it (reading only its slices from the files).
        `quant`: the attention and MLP projections in FP8 (workers/model/quantization.py); the embedding, the
        LM head, the norms and a mixture's experts and router stay in `dtype`."""
        shard = shard_plan(spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size,
                           tp.rank, tp.world) if tp is not None else None
        w = Weights(reader, dtype, device, shard, quant, getattr(ops, "adopt_weight", None))
        rope = rotary_cache(spec.head_dim, spec.rotary_dim, spec.rope_theta, spec.rope_scaling, max_positions,
                            device)
        local = (rotary_cache(spec.head_dim, spec.rotary_dim, spec.local_rope_theta, None, max_positions, device)
                 if spec.local_rope_theta is not None else rope)
        sliding = [bool(spec.layer_types) and spec.layer_types[i] == "sliding_attention"
                   for i in range(spec.num_layers)]
        layers = [cls.load_layer(w, spec, i, local if sliding[i] else rope, tp)
                  for i in tqdm(range(spec.num_layers), desc="mii_async: loading layers", unit="layer", leave=False)]
        for before, after in zip(layers, layers[1:]):       # a post-norm moves into the next layer's prologue
            if before.post_mlp_norm is not None:
                before.defer_post_mlp_norm, after.input_post_norm = True, before.post_mlp_norm
        for i, layer in enumerate(layers):
            if layer.attn.window != spec.window_of(i):
                raise UnsupportedModelError(f"sliding_window {spec.sliding_window} is not supported by "
                                            f"{cls.__name__}: its layer {i} does not attend within it")
        embedding = Embedding.load(w, "model.embed_tokens.weight", tp, cls.embedding_scale(spec))
        norm = RMSNorm.load(w, "model.norm.weight", spec.rms_norm_eps, cls.norm_offset)
        output = LMHead.load(w, "lm_head.weight", norm, embedding, spec, tp)
        return cls(spec, embedding, layers, output, ops, tp, shard)

    # -- a step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata, sample_rows: torch.Tensor,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """input_ids, positions [T] → logits [len(sample_rows), V] fp32. `between_layers()` runs on the host
        after each layer's kernels are enqueued (the engine reads the step in flight there)."""
        t = input_ids.shape[0]
        h = self.embed_tokens(input_ids)                                           # [T, H]
        fused = self._fused_decode(h, kv_caches, meta)
        if fused is not None:                       # the CPU op set's whole decode step in one call
            if between_layers is not None:
                between_layers()
            h, residual = fused(h, positions, meta)
            return self.head(h, residual, sample_rows)
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            q, residual = self.pre_attention(layer, h, residual, positions, meta.slot_mapping, k_cache, v_cache)
            attn = self.attention(layer, q, k_cache, v_cache, meta)                # [T, Hq, D]
            h, residual = self.post_attention(layer, attn.reshape(t, -1), residual)
            if between_layers is not None:
                between_layers()
        assert residual is not None
        return self.head(h, residual, sample_rows)

    def _fused_decode(self, h: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      meta: AttentionMetadata) -> Any:
        """The op set's one-call decode step (kernels/cpu_decode.py) where it has one, every layer is the plain
        pre-norm block it computes, and this step is one it runs; None otherwise. Built at the first step that
        could take it (the caches exist by then), and again for another list of caches."""
        make = getattr(self.ops, "decode_layers", None)
        if make is None or meta.num_decodes != h.shape[0]:
            return None
        built = self._fused
        if built is None or built[0] is not make or built[1] is not kv_caches:
            cls = type(self)
            plain = self.tp is None and all(   # the layers and the step as this class computes them, unchanged
                getattr(cls, name) is getattr(DecoderModel, name)
                for name in ("pre_attention", "attention", "post_attention", "head")) and all(
                type(y) is DecoderLayer and type(y.attn) is Attention and type(y.mlp) is GatedMLP
                and y.post_attn_norm is None and y.post_mlp_norm is None
                and y.attn.qkv_bias is None and y.attn.o_bias is None and y.attn.q_norm is None
                and y.attn.k_norm is None and y.attn.norm.eps == y.mlp.norm.eps == self.layers[0].attn.norm.eps
                and y.mlp.act == self.layers[0].mlp.act and y.attn.softcap == self.layers[0].attn.softcap
                and y.attn.scale == self.scale
                for y in self.layers)
            layers = [FusedLayer(y.attn.norm.weight, y.mlp.norm.weight, y.attn.qkv, y.attn.o, y.mlp.gate_up,
                                 y.mlp.down, k, v, y.attn.cos_sin, y.attn.window)
                      for y, (k, v) in zip(self.layers, kv_caches)] if plain else []
            first = self.layers[0]
            step = make(layers, first.attn.norm.eps, self.scale, first.attn.softcap,
                        first.mlp.act == "gelu_tanh") if plain else None
            self._fused = built = (make, kv_caches, step)
        step = built[2]
        return step if step is not None and step.runs(h, meta) else None

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → h [T, H]."""
        return self.embedding(input_ids)

    # A layer in three parts: the first and the last are what a piecewise CUDA graph holds (piecewise_graphs.py),
    # the attention between them runs eagerly.
    def pre_attention(self, layer: DecoderLayer, h: torch.Tensor, residual: torch.Tensor | None,
                      positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual +) norm, QKV, rotary, and this step's K/V written to the cache → q [T, Hq, D], residual."""
        return layer.pre_attention(self.ops, h, residual, positions, slot_mapping, k_cache, v_cache)

    def attention(self, layer: DecoderLayer, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D] → attn [T, Hq, D] (into `out` when given) over the paged KV cache."""
        return layer.attn.attend(self.ops, q, k_cache, v_cache, meta, out)

    def post_attention(self, layer: DecoderLayer, attn: torch.Tensor,
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [T, Hq·D] → o_proj, residual + norm, the MLP → h [T, H], residual."""
        return layer.post_attention(self.ops, attn, residual)

    def head(self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head, on `rows` only → logits [len(rows), V] fp32."""
        return self.output(self.ops, h[rows], residual[rows])
