"""FP8 weights on the CPU (the reference ops dequantize): a tiny random Llama quantized at load, and FP8
checkpoints in both formats written by our own code, against transformers running the dequantized weights
(the same greedy tokens and logits), and a bounded distance from the float original; TP=2 equals TP=1."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from mii_async.workers.model.fp8_checkpoint import dequantize_checkpoint, quantize_tensors, write_fp8_checkpoint

from ..helpers import make_engine, run_engine
from .family_parity import greedy, prompts_for

PROMPTS = prompts_for("fp8", [5, 23, 40, 17])
NEW = 16


def tiny_llama(path: Path, hidden: int = 64, heads: int = 4, kv: int = 2, ffn: int = 160, dtype=torch.float32) -> Path:
    """A random 2-layer Llama saved by transformers (norms moved off 1 so that they count)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=320, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                      initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(hidden + ffn)
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return path


def save_like(src: Path, tensors: dict[str, torch.Tensor], out: Path) -> Path:
    """A float checkpoint: `src`'s config (and generation config) with `tensors` as its weights, in fp32."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def float_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def fp8_checkpoint(src: Path, out: Path, scheme: str, static: bool = False) -> Path:
    config = json.loads((src / "config.json").read_text())
    return write_fp8_checkpoint(float_tensors(src), config, out, scheme, static)


def hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def last_logits(engine, prompt: list[int]) -> torch.Tensor:
    """The logits of `prompt`'s last position, from a hand-made step over blocks that no request holds yet (a
    fresh engine's first blocks): every rank of a TP group runs it alike."""
    from mii_async.workers.core.step_plan import ScheduledSeq, StepPlan

    blocks = list(range(-(-len(prompt) // 16)))
    return engine.runner.execute(StepPlan([ScheduledSeq(0, prompt, 0, blocks, True)], 0))[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


def check_against(engine, reference: Path, tol: float = 1e-4) -> torch.Tensor:
    """A fresh engine's last-position logits of a prompt are transformers' on `reference` within `tol`, and its
    greedy tokens (batched, chunked) are transformers'. Returns the engine's logits."""
    model = hf(reference)
    logits = last_logits(engine, PROMPTS[1])
    with torch.no_grad():
        ref = model(torch.tensor([PROMPTS[1]])).logits[0, -1]
    assert rel(logits, ref) < tol, f"logits' relative error {rel(logits, ref):.2e}"
    ours = run_engine(engine, PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW)
    for p, o in zip(PROMPTS, ours):
        assert o == greedy(model, p, NEW), f"greedy tokens differ for a prompt of {len(p)} tokens"
    return logits


OPTIONS = dict(device="cpu", dtype="float32", num_blocks=64, block_size=16, max_batch_tokens=32, max_num_seqs=8)


def test_quantized_at_load_matches_dequantized_model(tmp_path):
    """quantization="fp8" on a float checkpoint: the linears become e4m3 with per-channel scales; the engine
    answers as transformers does on the dequantized weights, and its logits stay near the float model's."""
    src = tiny_llama(tmp_path / "float")
    engine = make_engine(src, quantization="fp8", **OPTIONS)
    from mii_async.kernels.fp8_weight import FP8Weight

    layer = engine.model.layers[0]
    assert all(isinstance(t, FP8Weight) for t in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down))
    assert layer.attn.qkv.weight.dtype == torch.float8_e4m3fn and layer.attn.qkv.scale.shape == (64 + 2 * 32,)
    deq = save_like(src, dequantize_checkpoint(fp8_checkpoint(src, tmp_path / "ct", "channel")), tmp_path / "deq")
    logits = check_against(engine, deq)
    drift = rel(logits, last_logits(make_engine(src, **OPTIONS), PROMPTS[1]))
    # e4m3 keeps 3 mantissa bits (a weight within 1/16 of itself): a tiny random model drifts by some percent.
    assert 0 < drift < 0.15, f"FP8 logits {drift:.3f} from the float model's"


@pytest.mark.parametrize("scheme,static", [("channel", False), ("tensor", True), ("block", False)])
def test_fp8_checkpoint_matches_dequantized_model(tmp_path, scheme, static):
    """An FP8 checkpoint written by our own code (compressed-tensors per channel; per tensor with static input
    scales; transformers' fp8 with [128, 128] blocks) loads as FP8 without the `quantization` option and answers
    as transformers does on its dequantized weights."""
    src = tiny_llama(tmp_path / "float", hidden=256, ffn=384)
    ckpt = fp8_checkpoint(src, tmp_path / scheme, scheme, static)
    engine = make_engine(ckpt, **OPTIONS)
    from mii_async.kernels.fp8_weight import FP8Weight

    qkv = engine.model.layers[1].attn.qkv
    assert isinstance(qkv, FP8Weight) and qkv.blocked == (scheme == "block")
    assert (qkv.input_scale is not None) == static
    check_against(engine, save_like(src, dequantize_checkpoint(ckpt), tmp_path / "deq"))


def test_fp8_moe_checkpoint_keeps_experts_dense(tmp_path):
    """A mixture's FP8 checkpoint (Qwen3-MoE, experts quantized too): attention and the dense layer's MLP load as
    FP8, the experts dequantized into the model dtype; it answers as transformers on the dequantized weights."""
    from mii_async.kernels.fp8_weight import FP8Weight

    from .test_qwen3_moe import build_qwen3_moe

    src = build_qwen3_moe(tmp_path / "float")
    ckpt = fp8_checkpoint(src, tmp_path / "ct", "channel")
    from mii_async.workers.model.loader import WeightReader

    assert WeightReader(ckpt).get("model.layers.0.mlp.experts.3.down_proj.weight").dtype == torch.float8_e4m3fn
    engine = make_engine(ckpt, **OPTIONS)
    sparse, dense = engine.model.layers[0], engine.model.layers[1]
    assert isinstance(sparse.attn.qkv, FP8Weight) and isinstance(dense.mlp.down, FP8Weight)
    assert sparse.mlp.gate_up.dtype == torch.float32
    check_against(engine, save_like(src, dequantize_checkpoint(ckpt), tmp_path / "deq"))


def test_kv_cache_scheme_checkpoint_loads_with_the_cache_in_the_model_dtype(tmp_path):
    """A compressed-tensors checkpoint with a kv_cache_scheme (a K and a V scale a layer, as llm-compressor writes
    them) loads with the KV cache in the model dtype and answers exactly as the same checkpoint without the
    scheme (the scales with an FP8 cache: test_fp8_kv_scales.py)."""
    from mii_async.workers.model.fp8_checkpoint import FP8CheckpointWriter

    src = tiny_llama(tmp_path / "float")
    plain = fp8_checkpoint(src, tmp_path / "plain", "channel")
    writer = FP8CheckpointWriter(tmp_path / "kv", json.loads((src / "config.json").read_text()), "channel")
    writer.config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True,
                                                               "strategy": "tensor", "dynamic": False}
    writer.append(float_tensors(src))
    writer.append({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(0.02) for i in range(2) for n in "kv"})
    with_kv = writer.finish()
    a = last_logits(make_engine(plain, **OPTIONS), PROMPTS[2])
    assert torch.equal(last_logits(make_engine(with_kv, **OPTIONS), PROMPTS[2]), a)


def test_block_scales_follow_rows_and_columns(tmp_path):
    """Block scales of a weight whose sides are not multiples of 128 dequantize as the whole weight does, for
    every row span and for whole-block column spans; a column span inside a block is refused naming
    tensor_parallel."""
    from mii_async.errors import InvalidParameterError
    from mii_async.kernels.fp8_weight import dequantize
    from mii_async.workers.model.loader import TensorReader
    from mii_async.workers.model.quantization import WeightQuant
    from mii_async.workers.model.weights import Weights

    torch.manual_seed(0)
    tensors = quantize_tensors({"model.layers.0.mlp.down_proj.weight": torch.randn(200, 300)}, "block")
    whole = dequantize(tensors["model.layers.0.mlp.down_proj.weight"],
                       tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].repeat_interleave(128, 0)[:200])
    w = Weights(TensorReader(tensors), torch.float32, torch.device("cpu"), None,
                WeightQuant("fp8-block", "block", "weight_scale_inv"))
    name = "model.layers.0.mlp.down_proj.weight"
    for span in [(0, 200), (3, 131), (127, 129), (150, 200)]:
        part = w.linear([(name, span, 1)])
        assert torch.equal(part.dequantize(torch.float32), whole[span[0]:span[1]])
    for span in [(0, 128), (128, 300), (0, 300)]:
        assert torch.equal(w.linear_columns(name, span).dequantize(torch.float32), whole[:, span[0]:span[1]])
    with pytest.raises(InvalidParameterError, match="tensor_parallel"):
        w.linear_columns(name, (0, 150))
    assert torch.equal(w.rows(name, (5, 60)), whole[5:60])      # read where the model holds it dense: dequantized


def test_float8_weights_without_quantization_config_are_refused(tmp_path):
    """A float8 tensor in a checkpoint whose config.json gives no quantization_config is refused, naming it,
    rather than loaded without its scales."""
    from mii_async.errors import UnsupportedModelError

    src = tiny_llama(tmp_path / "float")
    ckpt = fp8_checkpoint(src, tmp_path / "ct", "channel")
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="float8 but config.json has no quantization_config"):
        make_engine(ckpt, **OPTIONS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, path: str, options: str, init: str, out: str) -> None:
    from mii_async.config import EngineConfig
    from mii_async.workers.engine import Engine
    from mii_async.workers.model.parallel import TPGroup

    torch.set_num_threads(1)
    tp = TPGroup(rank, world, init, torch.device("cpu")) if world > 1 else None
    eng = Engine(EngineConfig.from_kwargs(path, **json.loads(options)), tp=tp)
    logits = last_logits(eng, PROMPTS[0])
    if rank == 0:
        outs = run_engine(eng, PROMPTS[:3], max_new_tokens=12, ignore_eos=True)
        if tp is not None:
            eng.stop_followers()
        Path(out).write_text(json.dumps({"logits": logits.tolist(), "greedy": outs}))
    else:
        eng.follow()
    if tp is not None:
        tp.close()


def _run(path: Path, world: int, tmp_path: Path, **options) -> dict:
    out = tmp_path / f"tp{world}.json"
    args = (str(path), json.dumps({**OPTIONS, **options}), f"tcp://127.0.0.1:{_free_port()}", str(out))
    if world == 1:
        _rank_main(0, 1, *args)
    else:
        torch.multiprocessing.spawn(_rank_main, args=(world, *args), nprocs=world, join=True)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["at-load", "channel", "block"])
def test_tp2_equals_tp1(tmp_path, kind):
    """TP=2 (gloo) on FP8 weights, their scales sliced with them (quantized at load, whole rows' scales on the
    row-parallel ranks; a compressed-tensors checkpoint; a block-wise one): TP=1's logits and greedy tokens."""
    src = tiny_llama(tmp_path / "float", hidden=256, ffn=512)
    path, options = (src, {"quantization": "fp8"}) if kind == "at-load" else \
        (fp8_checkpoint(src, tmp_path / kind, kind), {})
    one, two = _run(path, 1, tmp_path, **options), _run(path, 2, tmp_path, **options)
    assert rel(torch.tensor(two["logits"]), torch.tensor(one["logits"])) < 1e-4
    assert one["greedy"] == two["greedy"]


def test_default_model_quantized_at_load_answers_paris(default_model_dir):
    """quantization="fp8" on the default model on the CPU (the reference ops): its chat answer to the capital
    question is still the float model's."""
    import mii_async

    with mii_async.pipeline(str(default_model_dir), quantization="fp8", device="cpu") as pipe:
        r = pipe.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=32)
    assert r.generated_text == "The capital of France is Paris."


def test_shards_spilled_to_another_directory_load_as_one_checkpoint(tmp_path):
    """A writer told to keep more free than the disk has puts its shards in the spill directory, linked from the
    checkpoint's; the checkpoint loads and answers exactly as one written in place."""
    from mii_async.workers.model.fp8_checkpoint import FP8CheckpointWriter

    src = tiny_llama(tmp_path / "float")
    config = json.loads((src / "config.json").read_text())
    tensors = float_tensors(src)
    written = []
    for out, spill in ((tmp_path / "in_place", None), (tmp_path / "linked", tmp_path / "spill")):
        writer = FP8CheckpointWriter(out, config, "channel", spill=spill, keep_free=1 << 62)
        layer0 = {k: v for k, v in tensors.items() if ".layers.0." in k}
        writer.append(layer0)
        writer.append({k: v for k, v in tensors.items() if k not in layer0})
        written.append(writer.finish())
    shards = sorted(written[1].glob("*.safetensors"))
    assert len(shards) == 2 and all(s.is_symlink() and s.resolve().parent == tmp_path / "spill" for s in shards)
    assert not any(s.is_symlink() for s in written[0].glob("*.safetensors"))
    a, b = (last_logits(make_engine(p, **OPTIONS), PROMPTS[0]) for p in written)
    assert torch.equal(a, b)
