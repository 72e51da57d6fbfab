"""gc_held: the garbage collected before CUDA graphs are captured, and none collected during the capture."""
from __future__ import annotations

import gc

from mii_async.workers.execute.capture_gc import gc_held


class _Cycle:
    freed: list[str] = []

    def __init__(self, name: str) -> None:
        self.name, self.me = name, self

    def __del__(self) -> None:
        _Cycle.freed.append(self.name)


def test_garbage_is_collected_before_and_not_during():
    _Cycle.freed.clear()
    _Cycle("before")
    with gc_held():
        assert _Cycle.freed == ["before"]
        assert not gc.isenabled()
        _Cycle("during")
        for _ in range(2000):                     # allocations that would start a collection
            [[]]
        assert _Cycle.freed == ["before"]
    assert gc.isenabled()
    gc.collect()
    assert _Cycle.freed == ["before", "during"]


def test_a_collector_left_off_stays_off():
    gc.disable()
    try:
        with gc_held():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
