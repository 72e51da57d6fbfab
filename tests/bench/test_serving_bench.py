"""`mii-async bench` end to end against the default model in real processes: every field present and
consistent, PNGs written, each target (router, OpenAI SSE, WebSocket), bad arguments refused clearly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from mii_async.bench.serving import main as bench

SMALL = ["--num-prompts", "6", "--input-len", "8", "32", "--output-len", "4", "12", "--no-progress", "--seed", "5"]


def _check_run(run: dict, asked: int, streamed: bool) -> None:
    """The figures of one run agree with each other and with the workload."""
    assert run["completed"] == 6 and run["failed"] == 0, run["errors"]
    assert run["total_output_tokens"] == asked                 # ignore_eos: exactly the lengths asked
    if streamed:
        assert run["total_streamed_tokens"] == asked          # what the chunks carried = the server's usage
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < run[f"median_{name}_ms"] <= run[f"p90_{name}_ms"] <= run[f"p99_{name}_ms"]
        assert run[f"mean_{name}_ms"] > 0 and run[f"std_{name}_ms"] >= 0
    assert run["median_ttft_ms"] <= run["median_e2el_ms"]
    assert run["output_throughput"] == pytest.approx(asked / run["duration_s"])
    assert run["total_token_throughput"] > run["output_throughput"]
    assert run["request_throughput"] == pytest.approx(6 / run["duration_s"])
    if "request_goodput" in run:
        assert 0 <= run["request_goodput"] <= run["request_throughput"]
    for sla in (2, 4, 6):
        assert 0 <= run[f"fastgen_effective_throughput_{sla}tok_s"] <= run["request_throughput"]
    assert (run["fastgen_sla_met_fraction_2tok_s"] >= run["fastgen_sla_met_fraction_4tok_s"]
            >= run["fastgen_sla_met_fraction_6tok_s"])


def _procs_with(mark: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_in_process_run_with_sweep_baseline_and_plots(tmp_path):
    """With no target it starts the model itself, sweeps two rates, runs the HF baseline, writes JSON and
    PNGs, and leaves no process behind."""
    mark = f"MII_BENCH_TEST_{uuid.uuid4().hex}"
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "mii_async.bench", *SMALL, "--request-rate", "8,inf", "--kv-cache-memory", "0.1",
           "--goodput", "ttft:60000", "tpot:60000", "--baseline", "hf", "--baseline-batch-size", "3",
           "--plot-dir", str(tmp_path / "plots"), "--result-json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, mark: "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    asked = r["runs"][0]["total_output_tokens"]
    assert [x["request_rate"] for x in r["runs"]] == [8.0, float("inf")]
    for run in r["runs"]:
        _check_run(run, asked, streamed=True)
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])   # SLOs of a minute: all meet
    assert r["baseline"]["output_tokens"] == asked and r["baseline"]["output_throughput"] > 0
    assert r["output_throughput_vs_baseline"] == pytest.approx(
        max(x["output_throughput"] for x in r["runs"]) / r["baseline"]["output_throughput"])
    names = sorted(os.path.basename(x) for x in r["plots"])
    assert names == ["latency_cdf_rate_8.png", "latency_cdf_rate_inf.png", "sweep.png",
                     "tokens_over_time_rate_8.png", "tokens_over_time_rate_inf.png"]
    for x in r["plots"]:
        with open(x, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(x) > 5000
    assert "Serving benchmark" in p.stdout and "Output token throughput" in p.stdout and "HF generate" in p.stdout
    deadline = time.monotonic() + 10
    while _procs_with(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _procs_with(mark), "the benchmark left processes behind"


@pytest.mark.parametrize("kind", ["router", "openai", "websocket"])
def test_each_target_of_a_running_deployment(kind, deployment, gateway_url, tmp_path, capsys):
    """The same workload through the router, the OpenAI endpoint and the WebSocket: complete and consistent."""
    target = {"router": deployment.address, "openai": gateway_url,
              "websocket": gateway_url.replace("http://", "ws://")}[kind]
    out = tmp_path / "r.json"
    assert bench(["--target", target, *SMALL, "--request-rate", "50,inf", "--max-concurrency", "4",
                  "--goodput", "ttft:1", "--result-json", str(out)]) == 0
    r = json.loads(out.read_text())
    for run in r["runs"]:
        _check_run(run, run["total_output_tokens"], streamed=kind != "openai")
        assert 4 * 6 <= run["total_output_tokens"] <= 12 * 6
        assert run["request_goodput"] == 0                       # nobody gets a first token within 1 ms
        # The second rate sends the same prompts: the reset before each run leaves it nothing cached.
        assert run["total_cached_prompt_tokens"] == 0 and run["prefix_blocks_forgotten"] >= 0
    assert r["runs"][1]["prefix_blocks_forgotten"] > 0          # the first run's prompts and outputs
    assert r["model"] and r["target"].startswith(kind)


def test_without_the_reset_a_sweep_hits_its_own_prompts(deployment, tmp_path):
    """--no-reset-prefix-cache: the second rate's prompts come from the prefix cache (what the reset avoids)."""
    out = tmp_path / "r.json"
    assert bench(["--target", deployment.address, *SMALL, "--seed", "6", "--request-rate", "50,inf",
                  "--no-reset-prefix-cache", "--result-json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert runs[1]["total_cached_prompt_tokens"] > 0 and runs[1]["prefix_blocks_forgotten"] is None


def test_bad_arguments_are_clear_errors(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    cases = [
        (["--target", "tcp://127.0.0.1:9", "--connect-timeout", "1"], "did not answer"),
        (["--target", "http://127.0.0.1:9", "--connect-timeout", "1"], "did not answer"),
        (["--target", "ws://127.0.0.1:9", "--connect-timeout", "1"], "did not open"),
        (["--target", "grpc://x"], "target: must start with"),
        (["--dataset", "prompts", "--dataset-path", str(tmp_path / "empty.txt")], "holds no prompt"),
        (["--dataset", "sharegpt"], "needs --dataset-path"),
        (["--input-len", "8000", "--output-len", "1000"], "exceeds the model's context of 8192"),
        (["--input-len", "50", "10"], "input_len"),
        (["--request-rate", "0"], "request_rate"),
        (["--request-rate", "fast"], "request_rate"),
        (["--goodput", "latency:5"], "goodput"),
        (["--max-concurrency", "0"], "max_concurrency"),
        (["--baseline", "vllm"], "baseline"),
        (["--target", "tcp://127.0.0.1:9", "--baseline", "hf"], "needs --model"),
    ]
    for args, message in cases:
        assert bench(args + ["--no-progress"]) == 2, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
