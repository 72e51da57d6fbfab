"""The vocabulary's two ends: Embedding (token ids → hidden states, scaled where the architecture scales them)
and LMHead (the final norm and the output projection → logits, soft-capped where the architecture caps them).
Under tensor parallelism both are vocab-parallel: each rank holds ceil(V/T) rows; the
lookup is masked to this rank's rows and all-reduced, the logits are all-gathered for the sampler on rank 0."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mii_async.kernels.int_weight import Int8Weight, quantize_int8

from ..parallel import TPGroup
from ..spec import ModelSpec
from ..weights import Weights
from .norm import RMSNorm

if TYPE_CHECKING:
    from mii_async.kernels.op_set import OpSet

log = logging.getLogger("mii_async.workers.model.loader")   # a loading message, under the loader's name


@dataclass
class Embedding:
    weight: torch.Tensor            # [V, H], or this rank's rows [hi - lo, H]
    vocab: tuple[int, int] | None   # this rank's rows [lo, hi) of the vocabulary; None: all of them
    tp: TPGroup | None
    scale: torch.Tensor | None = None   # [] in the weight's dtype: each looked-up row times it (Gemma: sqrt(H),
                                        # rounded to the activations' dtype as transformers rounds it)

    @classmethod
    def load(cls, w: Weights, name: str, tp: TPGroup | None, scale: float | None = None) -> Embedding:
        vocab = w.shard.vocab if w.shard is not None else None
        weight = w.rows(name, vocab)
        factor = torch.tensor(scale).to(device=weight.device, dtype=weight.dtype) if scale is not None else None
        return cls(weight, vocab, tp, factor)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → [T, H]."""
        if self.vocab is None:
            h = self.weight[input_ids]
            return h * self.scale if self.scale is not None else h
        lo, hi = self.vocab                                                     # vocab-parallel: mask, then sum
        local = input_ids - lo
        inside = (local >= 0) & (local < hi - lo)
        h = self.weight[local.clamp(0, hi - lo - 1)] * inside.unsqueeze(-1).to(self.weight.dtype)
        if self.scale is not None:
            h = h * self.scale
        assert self.tp is not None, "a vocabulary shard without its group"
        return self.tp.all_reduce(h)


@dataclass
class LMHead:
    norm: RMSNorm                   # the final norm: the head's prologue
    weight: torch.Tensor | Int8Weight   # [V, H] (the embedding's when tied), or this rank's [ceil(V/T), H], the
                                        # last rank's padded with zero rows so that every rank's logits are as
                                        # wide; int8 rows under quantization="int4"
    vocab_size: int                 # V: the gathered logits' padding is cut off at it
    tp: TPGroup | None
    softcap: float | None = None    # logits → softcap·tanh(logit / softcap), in fp32 (Gemma 2)

    @classmethod
    def load(cls, w: Weights, name: str, norm: RMSNorm, embedding: Embedding, spec: ModelSpec,
             tp: TPGroup | None) -> LMHead:
        """The head at `name`, or the embedding when the config ties them or the checkpoint has no head."""
        tied = spec.tie_word_embeddings or name not in w
        if tied and not spec.tie_word_embeddings:   # transformers would start a random head here
            log.warning("the checkpoint has no %s though tie_word_embeddings is false: the output head is the "
                        "input embedding", name)
        weight = embedding.weight if tied else w.rows(name, embedding.vocab)
        shard = w.shard
        if shard is not None and weight.shape[0] < shard.vocab_per_rank:
            weight = torch.cat([weight, weight.new_zeros(shard.vocab_per_rank - weight.shape[0], weight.shape[1])])
        if w.quant is not None and w.quant.integer:     # the CPU's int4 scheme reads the head as int8 rows
            weight = quantize_int8(weight, w.dtype)
        return cls(norm, weight, spec.vocab_size, tp, spec.final_logit_softcap)

    def __call__(self, ops: OpSet, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's h, residual [S, H] → logits [S, V] fp32."""
        tp = self.tp
        logits, _ = ops.add_rms_norm_linear(h, residual, self.norm.weight, self.norm.eps, self.weight,
                                            out_dtype=torch.float32 if tp is None else None)
        if tp is not None:                                                      # [S, ceil(V/T)] on each rank
            logits = tp.all_gather_last(logits)[:, :self.vocab_size].float()   # vocab-parallel lm_head
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
