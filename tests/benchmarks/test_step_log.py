"""StepLog times steps and attributes the collector's pauses to the steps they fell in."""
from __future__ import annotations

import gc
import time

from benchmarks.step_log import StepLog


def test_slow_steps_and_gc_pauses_are_attributed():
    junk = [[i] for i in range(200_000)]             # something for a full collection to walk

    def quick():
        return [1, 2]

    def slow():
        time.sleep(0.05)
        return [1]

    def collecting():
        gc.collect()
        return []

    with StepLog() as log:
        for fn in (quick, slow, quick, collecting, quick):
            log.step(fn)
    s = log.summary(slowest=5)
    assert s["steps"] == 5
    by_outputs = {st["outputs"]: st for st in s["slowest_steps"]}
    assert by_outputs[1]["ms"] >= 50 and by_outputs[1]["gc_ms"] == 0.0      # slow, and no collection in it
    assert by_outputs[0]["gc_ms"] > 0 and by_outputs[0]["gc_ms"] <= by_outputs[0]["ms"]   # the collection's step
    assert s["gc_gen2_pauses"] >= 1 and s["gc_ms_total"] >= by_outputs[0]["gc_ms"]
    assert [st["ms"] for st in s["slowest_steps"]] == sorted((st["ms"] for st in s["slowest_steps"]), reverse=True)
    assert len(junk) == 200_000
    assert log._on_gc not in gc.callbacks


def test_plans_group_steps_by_size_with_the_lag_of_async_scheduling():
    log = StepLog(lag=1)
    with log:
        # a plan is recorded as its step is launched; with lag 1 a step's wall time is the previous plan's
        for decodes, tokens, ctx, secs in ((0, 700, 0, 0.0), (4, 600, 400, 0.03), (8, 8, 800, 0.02), (8, 8, 900, 0.0)):
            log.plan(decodes, tokens, ctx)
            log.step(lambda secs=secs: time.sleep(secs) or [0])
    s = log.summary(slowest=4)
    rows = {r["tokens_from"]: r for r in s["by_tokens"]}
    assert sorted(rows) == [0, 512]                   # step 0 has no earlier plan: left out
    assert rows[512]["steps"] == 2 and rows[512]["tokens_mean"] == 650.0 and rows[512]["decodes_mean"] == 2.0
    assert rows[512]["decode_context_mean"] == 100.0  # 400 context over 4 decodes
    assert rows[512]["ms_mean"] >= 15                 # the 30 ms step ran the 700-token plan
    assert rows[0]["steps"] == 1 and rows[0]["decodes_mean"] == 8.0 and rows[0]["ms_mean"] < 15
    slowest = s["slowest_steps"][0]
    assert slowest["ms"] >= 30 and slowest["tokens"] == 700 and slowest["decodes"] == 0
    assert "by_tokens" not in StepLog().summary()
    (w0, steps, ms, decodes, tokens), = s["timeline"]      # all in the first second; step 0 has no plan
    assert w0 == 0.0 and steps == 3 and ms >= 15 and decodes == 4.0 and tokens == round(1308 / 3, 1)


def test_counters_moved_in_a_step_are_shown_with_it():
    n = {"retries": 0, "mallocs": 0}
    log = StepLog(counters=lambda: dict(n))

    def slow():
        n["retries"] += 1
        time.sleep(0.02)
        return [0]

    with log:
        log.step(lambda: [0])
        log.step(slow)
        log.step(lambda: n.__setitem__("mallocs", 3) or [0])
    s = log.summary(slowest=1)
    assert s["slowest_steps"][0]["counters"] == {"retries": 1}
    assert s["counters_total"] == {"retries": 1, "mallocs": 3} and s["steps_moving_counters"] == 2


class _Event:
    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, end: _Event) -> float:
        return end.t - self.t


def test_launches_show_host_and_gpu_time_beside_the_step_they_ran_in():
    log = StepLog(lag=1)
    with log:
        for i, (tokens, secs) in enumerate(((2048, 0.0), (8, 0.03), (8, 0.0))):
            log.plan(0, tokens, 0)
            log.launched(0.001 * (i + 1), _Event(0.0), _Event(10.0 * (i + 1)),   # GPU 10, 20, 30 ms
                         {"execute": 0.0005 * (i + 1)})
            log.step(lambda secs=secs: time.sleep(secs) or [0])
    s = log.summary(slowest=1)
    top = s["slowest_steps"][0]                   # the 30 ms step waited on plan 0 (lag 1)
    assert top["tokens"] == 2048 and top["gpu_ms"] == 10.0 and top["launch_host_ms"] == 1.0
    assert top["own_launch_host_ms"] == 2.0 and top["own_execute_ms"] == 1.0   # plan 1, launched in that step
    assert [r["launch"] for r in s["slowest_launches"]] == [2]
    assert s["slowest_launches"][0] == {"launch": 2, "host_ms": 3.0, "gpu_ms": 30.0, "decodes": 0, "tokens": 8,
                                        "execute_ms": 1.5}
    rows = {r["tokens_from"]: r for r in s["by_tokens"]}
    assert rows[2048]["steps"] == 1 and rows[2048]["gpu_ms_mean"] == 10.0 and rows[2048]["gpu_ms_max"] == 10.0
    assert rows[0]["gpu_ms_mean"] == 20.0 and rows[0]["launch_host_ms_mean"] == 2.0
