"""Serving metrics on hand-made records: vLLM's definitions, goodput and FastGen's effective throughput."""
from __future__ import annotations

import math

import pytest

from mii_async.bench.arrivals import arrival_offsets
from mii_async.bench.metrics import parse_goodput, summarize, tokens_over_time
from mii_async.bench.targets import RequestRecord
from mii_async.errors import InvalidParameterError


def _rec(start, chunks, tokens, prompt_len=512, error=None):
    return RequestRecord(prompt_len, sum(tokens), start, end=chunks[-1], chunk_times=list(chunks),
                         chunk_tokens=list(tokens), output_tokens=sum(tokens), error=error)


def test_vllm_definitions_on_known_records():
    """TTFT, TPOT, ITL, E2E and the throughputs come out as computed by hand."""
    a = _rec(0.0, [0.5, 0.6, 0.7, 0.8], [1, 1, 1, 1])           # ttft .5, tpot .1, itl .1 × 3, e2el .8
    b = _rec(1.0, [2.0, 2.4], [1, 2])                             # ttft 1, tpot (1.4 - 1) / 2 = .2, itl .4
    bad = RequestRecord(16, 4, 0.2, end=0.3, error="refused")
    s = summarize([a, b, bad], 0.0, goodput={"ttft": 600, "tpot": 150})
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_streamed_tokens"]) == (2, 1, 7, 7)
    assert s["duration_s"] == pytest.approx(2.4)
    assert s["mean_ttft_ms"] == pytest.approx(750) and s["median_ttft_ms"] == pytest.approx(750)
    assert s["mean_tpot_ms"] == pytest.approx(150)
    assert s["mean_itl_ms"] == pytest.approx((100 * 3 + 400) / 4)
    assert s["mean_e2el_ms"] == pytest.approx((800 + 1400) / 2)
    assert s["output_throughput"] == pytest.approx(7 / 2.4)
    assert s["total_token_throughput"] == pytest.approx((1024 + 7) / 2.4)
    assert s["request_goodput"] == pytest.approx(1 / 2.4)        # only `a` meets ttft ≤ 600 and tpot ≤ 150
    assert s["errors"] == ["refused"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert s[f"median_{name}_ms"] <= s[f"p90_{name}_ms"] <= s[f"p99_{name}_ms"]


def test_fastgen_sla_prompt_and_generation_speed():
    """The prompt SLA is prompt_len / 512 s; the generation SLA is on the EMA of per-token latency."""
    steady = _rec(0.0, [0.5 + 0.2 * i for i in range(20)], [1] * 20)           # 5 tok/s after a 0.5 s TTFT
    slow_start = _rec(0.0, [1.5 + 0.2 * i for i in range(20)], [1] * 20)       # TTFT 1.5 s > 512 / 512
    stall = _rec(0.0, [0.5, 0.6, 0.7, 3.7, 3.8, 3.9], [1] * 6)                # a 3 s gap: EMA above 0.5 s
    s = summarize([steady, slow_start, stall], 0.0)
    d = s["duration_s"]
    assert s["fastgen_effective_throughput_2tok_s"] == pytest.approx(1 / d)   # steady only
    assert s["fastgen_effective_throughput_4tok_s"] == pytest.approx(1 / d)
    assert s["fastgen_effective_throughput_6tok_s"] == 0                         # 5 tok/s < 6
    assert s["fastgen_sla_met_fraction_2tok_s"] == pytest.approx(1 / 3)
    # A chunk of 2 tokens after 0.3 s is 0.15 s per token: it meets a 6 tok/s SLA.
    two = _rec(0.0, [0.1, 0.4, 0.7, 1.0], [1, 2, 2, 2])
    assert summarize([two], 0.0)["fastgen_sla_met_fraction_6tok_s"] == 1.0


def test_goodput_parsing_names_the_parameter():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:9000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 9000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(InvalidParameterError, match="goodput"):
            parse_goodput(bad)


def test_tokens_over_time_adds_up():
    a = _rec(0.0, [0.2, 0.5, 1.2, 2.9], [1, 3, 2, 1])
    starts, rates = tokens_over_time([a], 0.0)
    assert starts == [0.0, 1.0, 2.0] and rates == [4.0, 2.0, 1.0]


def test_arrivals_all_at_once_poisson_and_gamma():
    """inf sends at 0; a rate R gives gaps averaging 1/R; burstiness changes their spread, not their mean."""
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    for shape in (1.0, 0.25, 4.0):
        t = arrival_offsets(4001, 20.0, shape, seed=1)
        gaps = [b - a for a, b in zip(t, t[1:])]
        assert t[0] == 0 and all(g >= 0 for g in gaps)
        assert sum(gaps) / len(gaps) == pytest.approx(0.05, rel=0.1)
    cv = []
    for shape in (0.25, 4.0):
        t = arrival_offsets(4001, 20.0, shape, seed=2)
        g = [b - a for a, b in zip(t, t[1:])]
        m = sum(g) / len(g)
        cv.append((sum((x - m) ** 2 for x in g) / len(g)) ** 0.5 / m)
    assert cv[0] > 1.5 > 0.7 > cv[1]                    # gamma: cv = 1 / sqrt(shape)
    with pytest.raises(InvalidParameterError, match="request_rate"):
        arrival_offsets(3, 0.0)
    with pytest.raises(InvalidParameterError, match="burstiness"):
        arrival_offsets(3, 1.0, 0.0)
