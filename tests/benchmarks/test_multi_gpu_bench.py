"""The issue-8 bench (TP=T against TP=1, R replicas) runs end to end on the CPU's tiny shape: the same script
is what runs on two GPUs. Real deployments: TP=2 over gloo, two replicas behind one router."""
from __future__ import annotations

import json


def test_multi_gpu_bench_on_the_cpu(tmp_path):
    from benchmarks.multi_gpu import main

    out = tmp_path / "r.json"
    result = main(["--shape", "tiny", "--tp", "2", "--replicas", "2", "--requests", "8", "--parity-prompts", "4",
                   "--parity-tokens", "12", "--bs1-tokens", "8", "--kv-cache-memory", "0.05", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["parity_tp_vs_tp1"]["identical"] == "4/4"            # fp32 on the CPU: the same tokens
    assert result["parity_tp_vs_tp1"]["max_chosen_logprob_gap"] < 1e-3
    runs = {(r["tensor_parallel"], r["replicas"]): r for r in result["runs"]}
    assert set(runs) == {(1, 1), (2, 1), (1, 2)}
    assert all(r["offline_output_tok_s"] > 0 for r in runs.values())
    assert set(runs[1, 2]["stats"]["replicas"]) == {"0", "1"}           # both replicas served requests
    assert all(rep["steps"] > 0 for rep in runs[1, 2]["stats"]["replicas"].values())
    assert result["bs1_tp_over_tp1"] > 0 and result["replicas_over_one"] > 0
