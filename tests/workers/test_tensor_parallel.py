"""Tensor parallelism on the CPU (gloo): shards give the logits and greedy tokens of the whole model."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from mii_async.errors import InvalidParameterError
from mii_async.workers.model.shard_plan import shard_plan

PROMPTS = [[1, 5, 9, 33, 70, 12, 8], [1, 200, 3, 4], [1, 17, 17, 17, 250, 31, 99, 100, 2, 45, 6]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, path: str, init: str, out: str) -> None:
    from mii_async.config import EngineConfig
    from mii_async.params import SamplingParams
    from mii_async.workers.engine import Engine
    from mii_async.workers.model.parallel import TPGroup
    from mii_async.workers.core.step_plan import ScheduledSeq, StepPlan

    torch.set_num_threads(1)
    tp = TPGroup(rank, world, init, torch.device("cpu")) if world > 1 else None
    eng = Engine(EngineConfig.from_kwargs(path, num_blocks=64, dtype="float32", device="cpu"), tp=tp)
    # Logits of a whole-prompt step with the same hand-made plan on every rank (no broadcast needed).
    plan = StepPlan([ScheduledSeq(i, p, 0, list(range(i * 2, i * 2 + 2)), True) for i, p in enumerate(PROMPTS)], 0)
    logits = eng.runner.execute(plan)
    if rank == 0:
        sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
        outs: dict[int, list[int]] = {}
        for i, p in enumerate(PROMPTS):
            eng.add_request(100 + i, p, sp)
        while eng.has_work():
            for o in eng.step():
                outs.setdefault(o.req_id, []).append(o.token_id)
        eng.stop_followers()
        Path(out).write_text(json.dumps({"logits": logits.tolist(), "greedy": [outs[100 + i] for i in range(len(PROMPTS))],
                                         "free": eng.block_manager.num_free, "blocks": eng.num_blocks}))
    else:
        eng.follow()
    if tp is not None:
        tp.close()


def _run(path: Path, world: int, tmp_path: Path) -> dict:
    out = tmp_path / f"tp{world}.json"
    if world == 1:
        _rank_main(0, 1, str(path), "", str(out))
    else:
        torch.multiprocessing.spawn(_rank_main, args=(world, str(path), f"tcp://127.0.0.1:{_free_port()}", str(out)),
                                    nprocs=world, join=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tp2_equals_tp1(kind, tiny_model, tmp_path):
    """TP=2 (gloo): logits within 1e-4 relative error of TP=1 and identical greedy tokens; KV all freed."""
    path = tiny_model(kind)
    one, two = _run(path, 1, tmp_path), _run(path, 2, tmp_path)
    a, b = torch.tensor(one["logits"]), torch.tensor(two["logits"])
    assert ((a - b).norm() / a.norm()).item() < 1e-4
    assert one["greedy"] == two["greedy"]
    assert two["free"] == two["blocks"]


def test_default_model_tp3_equals_tp1(default_model_dir, tmp_path):
    """The default model (9 heads, 3 KV heads) split over 3 ranks gives TP=1's logits and greedy tokens."""
    one, three = _run(default_model_dir, 1, tmp_path), _run(default_model_dir, 3, tmp_path)
    a, b = torch.tensor(one["logits"]), torch.tensor(three["logits"])
    assert ((a - b).norm() / a.norm()).item() < 1e-4
    assert one["greedy"] == three["greedy"]


def test_shard_plan_rules():
    """KV heads shard when T divides them and replicate when T exceeds them; impossible T names the heads."""
    p = shard_plan(8, 4, 160, 320, rank=1, world=2)
    assert (p.q_heads, p.kv_heads, p.ffn, p.vocab) == ((4, 8), (2, 4), (80, 160), (160, 320))
    p = shard_plan(8, 2, 160, 321, rank=3, world=4)          # T > Hkv: rank 3's heads 6,7 use KV head 1
    assert (p.q_heads, p.kv_heads, p.vocab, p.vocab_per_rank) == ((6, 8), (1, 2), (243, 321), 81)
    with pytest.raises(InvalidParameterError, match="9 attention heads") as e:
        shard_plan(9, 3, 1536, 49152, rank=0, world=2)
    assert e.value.param == "tensor_parallel"
