"""Writing FP8 checkpoints from float weights, in the two formats the loader reads (workers/model/quantization.py),
and reading one back dequantized: what the tests compare a loaded FP8 model against (transformers running the
dequantized weights), and how a benchmark makes a model that never exists in bf16 on the card.

`write_fp8_checkpoint(tensors, config, out, scheme)`: the decoder layers' projections (`*_proj.weight`) in e4m3
with their scales, every other tensor as given, and config.json with the quantization_config of `scheme`:
  "channel"  compressed-tensors, a scale per output channel, dynamic per-token activations
  "tensor"   compressed-tensors, one scale a weight, with `static_activations` a static input scale a linear
  "block"    transformers' fp8: [128, 128] blocks (`weight_scale_inv`), dynamic activations
Tensors may be written in several calls (`append`), a layer at a time, so that a large model is never whole
in memory; `finish` writes the index and config.json. A shard that would leave less than `keep_free` bytes on
the checkpoint's filesystem goes to `spill` instead (another filesystem: a RAM disk), linked from the checkpoint's
directory, so that a model larger than one disk is still one directory to load.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from mii_async.kernels.fp8_weight import BLOCK_K, E4M3_MAX, MIN_SCALE, dequantize, quantize_blocks, quantize_weight

SCHEMES = ("channel", "tensor", "block")
PROJECTION = re.compile(r"(^|\.)layers\.\d+\..*_proj\.weight$")


def quantization_config(scheme: str, static_activations: bool = False) -> dict[str, Any]:
    """config.json's quantization_config for `scheme`, as llm-compressor and transformers write it."""
    if scheme == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK_K, BLOCK_K]}
    assert scheme in SCHEMES, f"unknown FP8 scheme {scheme!r}"
    inputs = ({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
              if static_activations else
              {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True})
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": scheme, "dynamic": False,
               "group_size": None, "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def quantize_tensors(tensors: dict[str, torch.Tensor], scheme: str,
                     static_activations: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `tensors` under `scheme`: each projection as e4m3 with its scales (and input
    scale), the rest unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not PROJECTION.search(name) or t.dim() != 2:
            out[name] = t
            continue
        base = name[:-len("weight")]
        if scheme == "block":
            out[name], out[base + "weight_scale_inv"] = quantize_blocks(t)
            continue
        if scheme == "channel":
            q = quantize_weight(t)
            out[name], out[base + "weight_scale"] = q.weight, q.scale[:, None].contiguous()
        else:
            scale = (t.float().abs().amax() / E4M3_MAX).clamp(min=MIN_SCALE)
            q = quantize_weight(t, scale.expand(t.shape[0]))
            out[name], out[base + "weight_scale"] = q.weight, scale.reshape(1)
        if static_activations:          # a calibration would measure it: any positive scale is a valid checkpoint
            out[base + "input_scale"] = torch.tensor([8.0 / E4M3_MAX])
    return out


class FP8CheckpointWriter:
    """Writes model-0000i.safetensors files one `append` at a time, then the index and config.json."""

    def __init__(self, out: Path, config: dict[str, Any], scheme: str, static_activations: bool = False,
                 spill: Path | None = None, keep_free: int = 4 << 30) -> None:
        self.out, self.scheme, self.static = Path(out), scheme, static_activations
        self.spill, self.keep_free = (Path(spill) if spill is not None else None), keep_free
        self.config = {**config, "quantization_config": quantization_config(scheme, static_activations)}
        self.out.mkdir(parents=True, exist_ok=True)
        self.weight_map: dict[str, str] = {}
        self.size = 0

    def append(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        q = {k: v.contiguous().cpu() for k, v in quantize_tensors(tensors, self.scheme, self.static).items()}
        name = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
        nbytes = sum(t.numel() * t.element_size() for t in q.values())
        if self.spill is not None and shutil.disk_usage(self.out).free - nbytes < self.keep_free:
            self.spill.mkdir(parents=True, exist_ok=True)
            save_file(q, str(self.spill / name), metadata={"format": "pt"})
            os.symlink(self.spill / name, self.out / name)
        else:
            save_file(q, str(self.out / name), metadata={"format": "pt"})
        self.weight_map.update({k: name for k in q})
        self.size += nbytes

    def finish(self) -> Path:
        (self.out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": self.size}, "weight_map": self.weight_map}, indent=1))
        (self.out / "config.json").write_text(json.dumps(self.config, indent=1))
        return self.out


def write_fp8_checkpoint(tensors: dict[str, torch.Tensor], config: dict[str, Any], out: Path, scheme: str,
                         static_activations: bool = False) -> Path:
    """`tensors` (a float checkpoint's) written under `out` as an FP8 checkpoint of `scheme`, in one file."""
    writer = FP8CheckpointWriter(out, config, scheme, static_activations)
    writer.append(tensors)
    return writer.finish()


def dequantize_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an FP8 checkpoint written here, e4m3 weights multiplied out in fp32 (scales dropped):
    the float model that the FP8 one stands for."""
    from .loader import WeightReader

    reader = WeightReader(Path(path))
    out: dict[str, torch.Tensor] = {}
    for name in reader.names():
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
            continue
        t = reader.get(name)
        if t.dtype == torch.float8_e4m3fn:
            base = name[:-len("weight")]
            if base + "weight_scale_inv" in reader:            # [ceil(N/128), ceil(K/128)] blocks
                blocks = reader.get(base + "weight_scale_inv").float()
                scale = blocks.repeat_interleave(BLOCK_K, dim=0)[:t.shape[0]]
            else:
                scale = reader.get(base + "weight_scale").float().reshape(-1).expand(t.shape[0])
            t = dequantize(t, scale)
        out[name] = t
    return out
