"""The automatic tensor-parallel plan: smallest T the heads allow whose weight shard fits half a GPU."""
from __future__ import annotations

import json

from mii_async.router.parallel_plan import plan_tensor_parallel, weight_bytes


def _model(tmp_path, weight_bytes: int, heads: int = 32, kv: int = 8):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": heads, "num_key_value_heads": kv,
                                                      "intermediate_size": 14336, "vocab_size": 128256,
                                                      "torch_dtype": "bfloat16"}))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(weight_bytes)
    return tmp_path


def test_cpu_and_no_gpu_mean_one(tmp_path):
    """On the CPU, or with no GPU visible, the plan is T = 1."""
    path = _model(tmp_path, 1000)
    assert plan_tensor_parallel(path, "auto", "cpu")[0] == 1
    assert plan_tensor_parallel(path, "auto", "auto", gpus=[])[0] == 1


def test_smallest_fitting_degree(tmp_path):
    """16 GB of bf16 weights: T=1 on 80 GB GPUs, T=2 on 24 GB ones; 9 heads skip degrees they do not allow."""
    path = _model(tmp_path, 16 * 10**9)
    assert plan_tensor_parallel(path, "auto", "auto", gpus=[80 * 2**30] * 2)[0] == 1
    t, why = plan_tensor_parallel(path, "auto", "auto", gpus=[24 * 2**30] * 4)
    assert t == 2 and "tensor_parallel=2" in why
    odd = tmp_path / "odd"
    odd.mkdir()
    path = _model(odd, 16 * 10**9, heads=9, kv=3)
    (odd / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3,
                                                 "intermediate_size": 1536, "vocab_size": 49152,
                                                 "torch_dtype": "bfloat16"}))
    assert plan_tensor_parallel(path, "auto", "auto", gpus=[12 * 2**30] * 4)[0] == 3


def test_fp8_checkpoints_count_as_loaded(tmp_path):
    """An FP8 checkpoint counts as stored, but a mixture's e4m3 experts count at the model dtype's two bytes a
    weight, since they are dequantized as they load; quantization="fp8" halves a bf16 checkpoint."""
    import torch
    from safetensors.torch import save_file

    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64, dtype=torch.float8_e4m3fn),
               "model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(64, 32, dtype=torch.float8_e4m3fn),
               "model.layers.0.mlp.experts.0.down_proj.weight_scale": torch.ones(64, 1),
               "model.embed_tokens.weight": torch.zeros(100, 64, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    stored = (tmp_path / "model.safetensors").stat().st_size
    cfg = {"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "compressed-tensors"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert weight_bytes(tmp_path, "auto") == stored
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_experts": 8}))
    assert weight_bytes(tmp_path, "auto") == stored + 64 * 32
    assert weight_bytes(tmp_path, "float32") == stored + 3 * 64 * 32
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert weight_bytes(tmp_path, "auto", "fp8") == stored // 2
