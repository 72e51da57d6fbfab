"""The automatic tensor-parallel plan: the smallest T whose weight shard leaves a useful KV pool.

`tensor_parallel="auto"` (the default): with no GPU visible, T = 1. With GPUs, T is the smallest degree that
the model's head counts allow (workers/model/shard_plan.py) for which a rank's share of the weights takes at most
half of one GPU's memory, so that the KV pool and activations get the rest; at most the number of visible
GPUs. The router logs the choice and why. No torch here: GPU memory comes from `nvidia-smi`, the weights'
size from the safetensors files and the config's dtype.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

from ..errors import InvalidParameterError

log = logging.getLogger("mii_async.router")
WEIGHT_SHARE = 0.5          # of one GPU's memory, at most, for a rank's weights
_ITEMSIZE = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def gpu_memory_bytes() -> list[int]:
    """Total memory of each visible GPU (respecting CUDA_VISIBLE_DEVICES), [] when there is none."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    mem = {int(i): int(m) * 2**20 for i, m in (line.split(",") for line in out.strip().splitlines() if "," in line)}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        idx = [int(x) for x in visible.split(",") if x.strip().isdigit()]
        return [mem[i] for i in idx if i in mem]
    return [mem[i] for i in sorted(mem)]


def weight_bytes(model_path: Path, dtype: str, quantization: str | None = None) -> int:
    """The weights' size once loaded in `dtype` (auto: bfloat16 on GPU), or quantized to FP8 at load (one byte a
    weight; the embeddings, which stay in `dtype`, are counted as FP8 too: a plan, not an inventory). A
    checkpoint that is FP8 already is counted as it is stored, except a mixture's FP8 experts, which load in
    `dtype` (workers/model/layers/moe.py)."""
    cfg = json.loads((model_path / "config.json").read_text())
    stored = _ITEMSIZE.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), 4)
    files = sorted(model_path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    if cfg.get("quantization_config"):
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            size += _fp8_expert_bytes(files) * (_ITEMSIZE.get(dtype, 2) - 1)
        return size
    target = 1 if quantization == "fp8" else _ITEMSIZE.get(dtype, 2)
    return size * target // stored


def _fp8_expert_bytes(files: list[Path]) -> int:
    """Bytes of the e4m3 expert weights (`….experts.….weight`) in these safetensors files, from their headers (an
    8-byte little-endian length, then JSON naming each tensor's dtype and byte range)."""
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name != "__metadata__" and ".experts." in name and meta.get("dtype") == "F8_E4M3":
                start, end = meta["data_offsets"]
                total += end - start
    return total


def plan_tensor_parallel(model_path: Path, dtype: str, device: str, gpus: list[int] | None = None,
                         quantization: str | None = None) -> tuple[int, str]:
    """(T, why) for tensor_parallel="auto"."""
    if device == "cpu":
        return 1, "device is cpu: tensor_parallel=1"
    gpus = gpu_memory_bytes() if gpus is None else gpus
    if not gpus:
        return 1, "no GPU visible: tensor_parallel=1"
    need = weight_bytes(model_path, dtype, quantization)
    budget = int(min(gpus) * WEIGHT_SHARE)
    valid = []
    for t in range(1, len(gpus) + 1):
        try:
            check_tensor_parallel(model_path, t)
        except InvalidParameterError:
            continue
        valid.append(t)
        if need / t <= budget:
            return t, (f"weights {need / 2**30:.1f} GiB; at tensor_parallel={t} a rank holds {need / t / 2**30:.1f} GiB "
                       f"of its GPU's {min(gpus) / 2**30:.0f} GiB: the rest goes to the KV pool")
    t = max(valid)
    return t, (f"weights {need / 2**30:.1f} GiB do not fit {WEIGHT_SHARE:.0%} of a GPU even at tensor_parallel={t} "
               f"(the most that the {len(gpus)} visible GPU(s) and the model's heads allow): loading may fail")


def check_tensor_parallel(model_path: Path, world: int) -> None:
    """Refuses, naming the head counts, a tensor_parallel that the model's shapes do not allow."""
    from mii_async.workers.model.shard_plan import expert_ffn, shard_plan

    cfg = json.loads((model_path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    plan = shard_plan(heads, cfg.get("num_key_value_heads") or heads, cfg["intermediate_size"], cfg["vocab_size"],
                      0, world)
    if cfg.get("moe_intermediate_size"):       # every expert's FFN is split like the dense one
        expert_ffn(plan, int(cfg["moe_intermediate_size"]))
