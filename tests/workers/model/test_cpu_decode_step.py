"""The CPU op set's one-call decode step (kernels/cpu_decode.py): on int4 models whose layers it computes, each
decode step's logits are the op-by-op step's bit for bit (one request and several, a sliding window), on the
default model too; models it does not compute (per-head q/k norms) run op by op; a bad block id is an
IndexError."""
from __future__ import annotations

import pytest
import torch

from mii_async.kernels import cpu_build
from mii_async.params import SamplingParams

from ..helpers import make_engine, run_engine
from .test_fp8_models import tiny_llama

lib = cpu_build.load()
pytestmark = pytest.mark.skipif(lib is None or lib.int4_gemm_native() != 1,
                                reason="the one-call step needs the CPU library built with AVX512-BF16")
OPTIONS = dict(device="cpu", quantization="int4", kernels="cpu", num_blocks=64, block_size=16, max_num_seqs=8,
               threads=1)
PROMPTS = [[5 + (7 * i) % 300 for i in range(n)] for n in (40, 9, 70)]


def recording(engine, fused: bool) -> tuple[list[torch.Tensor], list[int]]:
    """The engine's model records each step's logits; `fused` False turns the one-call step off. Returns the
    logits and a one-item count of the steps the one-call step ran."""
    model, logits, ran = engine.model, [], [0]
    real_forward, real_fused = model.forward, model._fused_decode

    def forward(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        logits.append(out.clone())
        return out

    def fused_decode(*args):
        step = real_fused(*args) if fused else None
        ran[0] += step is not None
        return step

    model.forward, model._fused_decode = forward, fused_decode
    return logits, ran


def same_steps(path, prompts, **options) -> int:
    """Two engines on `path`, one with the one-call step, one op by op: every step's logits equal, the tokens
    equal. Returns how many steps the one-call step ran."""
    runs = []
    for fused in (True, False):
        engine = make_engine(path, **{**OPTIONS, **options})
        logits, ran = recording(engine, fused)
        tokens = run_engine(engine, prompts, max_new_tokens=12, ignore_eos=True)
        runs.append((logits, ran[0], tokens))
    (a, ran, ta), (b, _, tb) = runs
    assert ta == tb and len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "a step's logits differ"
    return ran


def test_one_call_steps_equal_op_by_op_steps(tmp_path):
    src = tiny_llama(tmp_path / "m", hidden=128, heads=4, kv=2, ffn=192)
    assert same_steps(src, PROMPTS[:1]) >= 10                   # one request: every decode step
    assert same_steps(src, PROMPTS) >= 10                       # three at once, and then fewer


def test_a_sliding_window_and_the_steps_it_runs(tmp_path):
    """Mistral with a window shorter than the prompts: the layers attend within it in the one-call step too."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=320, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=24,
                        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    MistralForCausalLM(cfg).save_pretrained(str(tmp_path / "mistral"))
    assert same_steps(tmp_path / "mistral", PROMPTS) >= 10


def test_a_model_it_does_not_compute_runs_op_by_op(tmp_path):
    """Qwen3's per-head norms of q and k are not in the one-call step: every step runs op by op."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=320, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(str(tmp_path / "qwen3"))
    assert same_steps(tmp_path / "qwen3", PROMPTS[:1]) == 0


def test_the_default_model(default_model_dir):
    """SmolLM2-135M's int4 layers (its GGUF's Q4_1, 30 layers, GQA 9/3): the same steps either way."""
    assert same_steps(default_model_dir, PROMPTS[:2]) >= 10


def test_a_block_id_out_of_range_is_an_index_error(tmp_path):
    """A step whose block table points past the pool raises before the op that reads it writes anything, and
    the engine goes on."""
    from mii_async.workers.core.step_plan import ScheduledSeq, StepPlan

    engine = make_engine(tiny_llama(tmp_path / "m", hidden=128, heads=4, kv=2, ffn=192), **OPTIONS)
    engine.add_request(0, PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True))
    while engine.has_work():
        engine.step()
    step = engine.model._fused_decode
    seen = []
    engine.model._fused_decode = lambda *a: seen.append(step(*a)) or seen[-1]
    with pytest.raises(IndexError, match="out of range"):
        engine.runner.execute(StepPlan([ScheduledSeq(0, [5], 17, [10_000, 10_001], True)], 1))
    assert seen and seen[0] is not None
    assert run_engine(engine, PROMPTS[:1], max_new_tokens=4, ignore_eos=True)[0]
