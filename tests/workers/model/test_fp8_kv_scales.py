"""A checkpoint's calibrated K/V scales (compressed-tensors `kv_cache_scheme`) with an FP8 KV cache (CPU, the
reference ops): the scales fold into the attention weights, so that the cache holds K / k_scale and V / v_scale
within e4m3's range and the logits stay those of the model-dtype cache; the same checkpoint without its scales
saturates. The models are tiny random ones whose K and V are made ~1000 times larger while the model's function is
kept (q, or its norm, and o_proj scaled the other way), as calibration exists for."""
from __future__ import annotations

import json

import pytest
import torch

from mii_async.kernels.kv_store import FP8_KV
from mii_async.workers.model.fp8_checkpoint import FP8CheckpointWriter

from ..helpers import make_engine
from .family_parity import prompts_for
from .test_fp8_models import OPTIONS, float_tensors, last_logits, rel, tiny_llama

BIG = 1000.0                # K and V magnitudes: past e4m3's 448 unless divided by their scales
SCALE = 16.0                # the checkpoint's K and V scale
PROMPT = prompts_for("kv-scales", [45])[0]


def _qwen3(path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .family_parity import SHAPE, save_tiny

    return save_tiny(Qwen3ForCausalLM, Qwen3Config(**{**SHAPE, "num_hidden_layers": 2}), path)


def _big_kv(tensors: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """K and V BIG times larger, q and o_proj BIG times smaller: every score and output is what it was."""
    k, q = ("self_attn.k_norm.weight", "self_attn.q_norm.weight") if family == "qwen3" else \
        ("self_attn.k_proj.weight", "self_attn.q_proj.weight")
    factors = {k: BIG, q: 1 / BIG, "self_attn.v_proj.weight": BIG, "self_attn.o_proj.weight": 1 / BIG}
    return {name: t * next((f for suffix, f in factors.items() if name.endswith(suffix)), 1.0)
            for name, t in tensors.items()}


def _checkpoint(src, tensors, out, layers: int, with_scales: bool):
    writer = FP8CheckpointWriter(out, json.loads((src / "config.json").read_text()), "channel")
    if with_scales:
        writer.config["quantization_config"]["kv_cache_scheme"] = {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    writer.append(tensors)
    if with_scales:
        writer.append({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(SCALE) for i in range(layers)
                       for n in "kv"})
    return writer.finish()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_checkpoint_kv_scales_fold_into_an_fp8_cache(tmp_path, family):
    """(Llama: the k rows of QKV take the division; Qwen3: the k norm's weight, since the norm follows QKV.)"""
    src = tiny_llama(tmp_path / "float") if family == "llama" else _qwen3(tmp_path / "float")
    tensors = _big_kv(float_tensors(src), family)
    scaled = _checkpoint(src, tensors, tmp_path / "scaled", 2, True)
    plain = _checkpoint(src, tensors, tmp_path / "plain", 2, False)

    wide = make_engine(scaled, **OPTIONS)                                # fp32 cache: the scales are not needed
    narrow = make_engine(scaled, **OPTIONS, kv_cache_dtype="fp8")
    ref, got = last_logits(wide, PROMPT), last_logits(narrow, PROMPT)
    saturated = last_logits(make_engine(plain, **OPTIONS, kv_cache_dtype="fp8"), PROMPT)
    assert rel(got, ref) < 0.1, rel(got, ref)
    assert rel(saturated, ref) > 3 * rel(got, ref), (rel(saturated, ref), rel(got, ref))

    # The cache holds K / SCALE and V / SCALE (in range: nothing at ±448), close to the fp32 cache's K and V: in
    # the first layer, whose input is the same, each element within e4m3's rounding (3 mantissa bits).
    slots = torch.arange(len(PROMPT))
    for layer in range(2):
        for which in range(2):
            cache = narrow.runner.kv_caches[layer][which]
            assert cache.dtype == FP8_KV
            stored = cache.view(torch.uint8).flatten(0, 1)[slots].view(FP8_KV).float() * SCALE
            wide_kv = wide.runner.kv_caches[layer][which].flatten(0, 1)[slots]
            assert stored.abs().max() < 448 * SCALE
            assert wide_kv.abs().max() > 448                               # it would have saturated unscaled
            assert rel(stored, wide_kv) < 0.1
            if layer == 0:
                assert ((stored - wide_kv).abs() <= wide_kv.abs() / 16 + SCALE * 2 ** -10).all()
