"""StepLog times steps and attributes the collector's pauses to the steps they fell in."""
from __future__ import annotations

import gc
import time

from mii_async.bench.step_log import StepLog


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
