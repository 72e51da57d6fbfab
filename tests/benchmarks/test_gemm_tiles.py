"""The GEMM staircase probe: its arithmetic on known cost curves, and a real run on the CPU at a tiny shape."""
from __future__ import annotations

import json

import pytest

from benchmarks.gemm_tiles import cut_savings, main


def test_cut_savings_of_a_staircase_and_a_line():
    """Whole 128-token tiles: a cut to 128 saves what the partial tile cost; a linear cost saves nothing."""
    steps = {m: float(-(-m // 128)) for m in range(128, 1024, 16)}
    s = cut_savings(steps, [128, 64])
    # M = 144: 2 tiles for 144 tokens against 1 for 128, so 1 − (1/128) / (2/144) = 0.4375
    assert s[128]["max"] == pytest.approx(1 - (1 / 128) / (2 / 144))
    assert s[128]["min"] == 0.0 and s[128]["mean"] > 0.1 and s[128]["points"] == len(steps)
    line = cut_savings({m: 2.0 * m for m in range(128, 1024, 16)}, [128])
    assert line[128]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert cut_savings({200: 1.0}, [128]) == {}          # the cut (128) was not timed


def test_runs_on_cpu(tmp_path, capsys):
    """A tiny shape on the CPU: one time per token count, and a saving per multiple, in the JSON."""
    out = tmp_path / "r.json"
    assert main(["--shape", "tiny", "--tokens", "16:80:16", "--multiples", "32", "--repeats", "2",
                 "--device", "cpu", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert sorted(int(m) for m in r["layer_seconds"]["cpu"]) == [16, 32, 48, 64]
    assert all(t > 0 for t in r["layer_seconds"]["cpu"].values())
    assert r["cut_savings"]["cpu"]["32"]["points"] == 3   # 16 has no cut in the range; 32 and 64 save 0
    assert "what it saves" in capsys.readouterr().out


def test_bad_range_names_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["--tokens", "80:16:8", "--device", "cpu", "--shape", "tiny"])
    assert "--tokens" in capsys.readouterr().err
