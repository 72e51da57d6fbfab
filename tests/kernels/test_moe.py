"""The mixture-of-experts ops: the reference against transformers' sparse blocks (CPU), the CUDA path's permute
→ grouped GEMMs → un-permute against the reference (on the CPU through torch's own grouped_mm, and in bf16 on the
GPU), and the GPU op captured in a CUDA graph and replayed on new inputs."""
from __future__ import annotations

import pytest
import torch

from mii_async.kernels import cuda as K
from mii_async.kernels import reference as R


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values"
    return (torch.linalg.norm(out.float() - ref.float()) / torch.linalg.norm(ref.float())).item()


def experts(e: int, h: int, f: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random router [E, H], gate_up [E, 2F, H] and down [E, H, F], scaled so that outputs stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(e, h, generator=g) / h ** 0.5
    gate_up = torch.randn(e, 2 * f, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, f, generator=g) / f ** 0.5
    return tuple(t.to(device, dtype) for t in (router, gate_up, down))


@pytest.mark.parametrize("family,renormalize", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_reference_equals_transformers_sparse_block(family, renormalize):
    """route + experts on a transformers sparse block's own weights give its output (fp32, 1e-6), with the
    chosen weights renormalised and not."""
    import transformers

    if family == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_local_experts=8,
                                         num_experts_per_tok=2)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=48, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=renormalize)
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    cfg._experts_implementation = "eager"
    torch.manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
        x = torch.randn(1, 37, 64)
        ref = block(x)[0]
        weights, ids = R.moe_route(x[0], block.gate.weight, 2, renormalize)
        out = R.moe_experts(x[0], weights, ids, block.experts.gate_up_proj, block.experts.down_proj)
    assert rel(out, ref) < 1e-6
    assert torch.allclose(weights.sum(-1), torch.ones(37)) == renormalize


def test_grouped_path_equals_reference_on_cpu():
    """The CUDA path's sort → grouped GEMMs → un-permute → combine, run on the CPU through torch's grouped_mm,
    gives the reference, at one token, at a few, and at more tokens than experts (experts left empty included)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    router, gate_up, down = experts(16, 64, 32)
    for t, k in ((1, 2), (3, 4), (100, 2), (100, 8)):
        x = torch.randn(t, 64)
        weights, ids = R.moe_route(x, router, k, renormalize=False)
        ref = R.moe_experts(x, weights, ids, gate_up, down)
        out = K._grouped_experts(x, weights, ids, gate_up, down, R.silu_and_mul)
        assert rel(out, ref) < 1e-5, (t, k)


def test_every_expert_equals_reference():
    """The graph-capturable fallback (every expert over every token, zero weight where not chosen) gives the
    reference."""
    router, gate_up, down = experts(8, 64, 32)
    x = torch.randn(20, 64)
    weights, ids = R.moe_route(x, router, 2, renormalize=True)
    assert rel(K._every_expert(x, weights, ids, gate_up, down), R.moe_experts(x, weights, ids, gate_up, down)) < 1e-5


# -- on the GPU ------------------------------------------------------------------------------------------------

SHAPES = {"e8-top2": (8, 2, 1024, 1792), "e128-top8": (128, 8, 512, 256)}   # E, k, H, F


def _gpu_ops():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("cupy")
    from mii_async.kernels import get_ops

    return get_ops("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", [1, 2, 7, 64, 257, 2048])
def test_cuda_experts_match_reference_bf16(shape, t):
    """bf16 on the GPU: the grouped-GEMM path is taken on Hopper, and route + experts are within 1e-2 relative
    error of the fp32 reference on the same bf16 inputs and the same routing."""
    ops = _gpu_ops()
    e, k, h, f = SHAPES[shape]
    router, gate_up, down = experts(e, h, f, "cuda", torch.bfloat16, seed=t)
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    if torch.cuda.get_device_capability()[0] == 9:
        assert K._grouped_mm_ok(x, gate_up, down), "Hopper in bf16 must take the grouped GEMMs"
    weights, ids = ops.moe_route(x, router, k, True)
    out = ops.moe_experts(x, weights, ids, gate_up, down)
    ref = R.moe_experts(x.float(), weights, ids, gate_up.float(), down.float())
    assert out.dtype == torch.bfloat16 and out.shape == (t, h)
    assert rel(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_cuda_experts_replay_in_a_cuda_graph(dtype, t):
    """route + experts captured in a CUDA graph (E=128, top-8) and replayed on three new inputs copied into the
    static input give what the eager op gives on each (bf16 on Hopper: the grouped GEMMs, the same kernels;
    fp16: the reference eagerly, every expert over every token inside the graph)."""
    ops = _gpu_ops()
    router, gate_up, down = experts(128, 512, 256, "cuda", dtype, seed=t)
    static_x = torch.randn(t, 512, device="cuda").to(dtype)
    grouped = K._grouped_mm_ok(static_x, gate_up, down)        # else eager and captured runs take two paths

    def layer(x: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.moe_route(x, router, 8, False)
        return ops.moe_experts(x, weights, ids, gate_up, down)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x)                                          # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(t, 512, device="cuda").to(dtype)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        eager = layer(x)
        assert rel(static_out, eager) < (1e-5 if grouped else 1e-2)
