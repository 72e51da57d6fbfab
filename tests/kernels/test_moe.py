"""The mixture-of-experts ops: the reference against transformers' sparse blocks (CPU), the CUDA path's permute
→ grouped GEMMs → un-permute against the reference (on the CPU through torch's own grouped_mm, and in bf16 on the
GPU), the few-token kernels (moe_gemv.cu) against the reference, and the GPU ops captured in a CUDA graph and
replayed on new inputs."""
from __future__ import annotations

import pytest
import torch
from mii_async.kernels import cuda as K
from mii_async.kernels import cuda_moe as M
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
        out = M.grouped(x, weights, ids, gate_up, down, R.silu_and_mul)
        assert rel(out, ref) < 1e-5, (t, k)


def test_every_expert_equals_reference():
    """The graph-capturable fallback (every expert over every token, zero weight where not chosen) gives the
    reference."""
    router, gate_up, down = experts(8, 64, 32)
    x = torch.randn(20, 64)
    weights, ids = R.moe_route(x, router, 2, renormalize=True)
    assert rel(M.every_expert(x, weights, ids, gate_up, down), R.moe_experts(x, weights, ids, gate_up, down)) < 1e-5


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
        assert M.grouped_mm_ok(x, gate_up, down), "Hopper in bf16 must take the grouped GEMMs"
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
    grouped = M.grouped_mm_ok(static_x, gate_up, down)        # else eager and captured runs take two paths

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


# -- a few tokens: moe_gemv.cu ----------------------------------------------------------------------------------

FEW = {**SHAPES, "qwen3-30b-a3b": (128, 8, 2048, 768), "odd": (40, 3, 264, 88)}


def _poison_allocator() -> None:
    """Fills the caching allocator's free blocks with 0xFF bytes (NaN in bf16, fp16 and fp32), so that an output
    the kernels leave unwritten shows: one large block, and blocks of the small pool (up to 1 MiB), from which
    it serves the few-token outputs."""
    junk = [torch.full((256 << 20,), 255, dtype=torch.uint8, device="cuda")]
    junk += [torch.full((size,), 255, dtype=torch.uint8, device="cuda") for size in (512, 4096, 32768, 262144)
             for _ in range(16)]
    del junk


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(FEW))
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_few_tokens_match_reference(dtype, shape, t, renormalize, with_residual):
    """add_rms_norm_moe of one or two tokens takes moe_gemv.cu: the residual stream is the reference's bit for
    bit; the experts chosen are those of the k largest router logits, in descending order, with the softmax
    weights (renormalised or not) of the reference's formula (equal logits may be chosen in another order than
    torch.topk's); and the output is within 1e-2 of the reference in fp32 over the same weights and routing."""
    ops = _gpu_ops()
    e, k, h, f = FEW[shape]
    router, gate_up, down = experts(e, h, f, "cuda", dtype, seed=t + 10 * k)
    norm_w = (1 + 0.1 * torch.randn(h, device="cuda")).to(dtype)
    x = torch.randn(t, h, device="cuda").to(dtype)
    res = torch.randn(t, h, device="cuda").to(dtype) if with_residual else None
    assert M.few_tokens_ok(x, router, gate_up, down, k)
    _poison_allocator()
    out, stream = ops.add_rms_norm_moe(x, res, norm_w, 1e-6, router, gate_up, down, k, renormalize)
    assert torch.equal(stream, x if res is None else x + res)
    logits, _ = K._gemv("norm", x, router, None, ops.config, torch.float32, res, norm_w, 1e-6)
    _poison_allocator()
    _, weights, ids = M.few_tokens(stream, norm_w, 1e-6, logits, k, renormalize, gate_up, down)
    assert torch.equal(logits.gather(1, ids), torch.topk(logits, k).values), "not the k largest logits"
    probs = torch.softmax(logits, -1).gather(1, ids)
    assert torch.allclose(weights, probs / probs.sum(-1, keepdim=True) if renormalize else probs, rtol=1e-5, atol=0)
    normed = R.rms_norm(stream, norm_w, 1e-6)
    ref = R.moe_experts(normed.float(), weights, ids, gate_up.float(), down.float())
    assert out.dtype == dtype and out.shape == (t, h)
    assert rel(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2])
def test_few_tokens_replay_in_a_cuda_graph(t):
    """add_rms_norm_moe of a few tokens captured in a CUDA graph and replayed on new inputs gives the eager op's
    output bit for bit (the same kernels; the routing read on the device)."""
    ops = _gpu_ops()
    router, gate_up, down = experts(128, 2048, 768, "cuda", torch.bfloat16, seed=t)
    norm_w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    static_x, static_res = (torch.randn(t, 2048, device="cuda").bfloat16() for _ in range(2))

    def layer(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        return ops.add_rms_norm_moe(x, res, norm_w, 1e-6, router, gate_up, down, 8, True)[0]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x, static_res)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x, static_res)
    for seed in range(3):
        torch.manual_seed(seed)
        x, res = (torch.randn(t, 2048, device="cuda").bfloat16() for _ in range(2))
        static_x.copy_(x)
        static_res.copy_(res)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, layer(x, res))


@pytest.mark.gpu
@pytest.mark.parametrize("fill", ["nan", "-inf", "mixed"])
def test_few_tokens_route_to_real_experts_whatever_the_logits(fill):
    """Router logits with NaN, or fewer than k above -inf: every chosen id still names a distinct expert (the
    finite logits first, largest first, then the others in expert order), so the experts' reads stay in their
    weights and the process goes on; the outputs may be NaN, as the model's numbers are."""
    e, k, h, f = 40, 3, 264, 88
    router, gate_up, down = experts(e, h, f, "cuda", torch.bfloat16, seed=3)
    norm_w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, h, device="cuda").bfloat16()
    logits = torch.full((2, e), float(fill) if fill != "mixed" else float("nan"), device="cuda")
    if fill == "mixed":                         # one finite logit, one -inf, the rest NaN
        logits[:, 7], logits[:, 5] = 1.0, float("-inf")
    _, _, ids = M.few_tokens(x, norm_w, 1e-6, logits, k, True, gate_up, down)
    torch.cuda.synchronize()
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < e)).all() and all(len(set(row.tolist())) == k for row in ids)
    if fill == "mixed":
        assert ids[:, 0].tolist() == [7, 7] and ids[:, 1:].tolist() == [[0, 1], [0, 1]]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("e,k,h,f", [(128, 8, 2048, 768), (8, 2, 1024, 512), (16, 3, 264, 256),
                                     (8, 2, 1024, 1792), (8, 2, 512, 3584)])
@pytest.mark.parametrize("t", [1, 2])
def test_kernel_variants_give_the_same_bits(dtype, e, k, h, f, t):
    """moe_down_wide (every slot's down row read as one long row) against moe_down, and moe_gate_up with every
    warp routing against one warp a block, on the same routing: the same bits, each output row written."""
    router, gate_up, down = experts(e, h, f, "cuda", dtype, seed=t + e)
    norm_w = torch.ones(h, device="cuda", dtype=dtype)
    x = torch.randn(t, h, device="cuda").to(dtype)
    logits, _ = K._gemv("norm", x, router, None, _gpu_ops().config, torch.float32, None, norm_w, 1e-6)
    _poison_allocator()
    base = M.few_tokens(x, norm_w, 1e-6, logits, k, True, gate_up, down, wide=False, every_warp=False)
    for wide, every_warp in ((True, False), (False, True), (True, True)):
        _poison_allocator()
        out = M.few_tokens(x, norm_w, 1e-6, logits, k, True, gate_up, down, wide=wide, every_warp=every_warp)
        assert not any(t.float().isnan().any() for t in out[:2])
        assert all(torch.equal(a, b) for a, b in zip(base, out)), (wide, every_warp)


@pytest.mark.parametrize("f,k,wide", [(768, 8, True), (14336, 2, False), (7168, 2, True), (3584, 2, False),
                                      (384, 8, False), (256, 3, True), (512, 2, True), (2048, 8, False)])
def test_the_wide_down_rows_are_chosen_where_they_save_steps(f, k, wide):
    """Steps a row: k·⌈F/8/256⌉ for moe_down against ⌈k·F/8/256⌉ for moe_down_wide, which needs F % 256 == 0."""
    assert M.wide_saves_steps(f, k) is wide


def test_wide_down_rows_are_refused_for_an_ffn_size_they_do_not_take():
    with pytest.raises(ValueError, match="multiple of 256, got 88"):
        M.few_tokens(torch.zeros(1, 264), torch.ones(264), 1e-6, torch.zeros(1, 40), 3, True,
                     torch.zeros(40, 176, 264), torch.zeros(40, 264, 88), wide=True)
