"""StepLog: the wall time of every engine step of a run, and the garbage collector's pauses in it, so that the
slowest steps of a benchmark (its ITL tail) can be told apart: a long GPU step, or the host stalled by a
collection."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field


@dataclass
class StepLog:
    steps: list[tuple[float, float, int]] = field(default_factory=list)   # (start s, seconds, outputs)
    pauses: list[tuple[float, float, int]] = field(default_factory=list)  # (start s, seconds, generation)
    _t0: float = 0.0
    _gc_start: float = 0.0

    def __enter__(self) -> StepLog:
        self._t0 = time.perf_counter()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_start = now
        else:
            self.pauses.append((self._gc_start - self._t0, now - self._gc_start, info["generation"]))

    def step(self, fn):
        """Runs one step `fn()` (a list of outputs), timed."""
        a = time.perf_counter()
        outs = fn()
        self.steps.append((a - self._t0, time.perf_counter() - a, len(outs)))
        return outs

    def summary(self, slowest: int = 10) -> dict:
        """The slowest steps (ms, outputs, the GC pause ms inside each) and the collector's totals."""
        def gc_in(start: float, secs: float) -> float:
            return sum(d for t, d, _ in self.pauses if start <= t < start + secs)

        top = sorted(self.steps, key=lambda s: -s[1])[:slowest]
        ms = sorted(1e3 * d for _, d, _ in self.steps)
        return {"steps": len(self.steps),
                "step_ms_p50": ms[len(ms) // 2] if ms else 0.0,
                "step_ms_p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else 0.0,
                "slowest_steps": [{"at_s": round(t, 3), "ms": round(1e3 * d, 2), "outputs": n,
                                   "gc_ms": round(1e3 * gc_in(t, d), 2)} for t, d, n in top],
                "gc_pauses": len(self.pauses), "gc_ms_total": round(1e3 * sum(d for _, d, _ in self.pauses), 2),
                "gc_ms_max": round(1e3 * max((d for _, d, _ in self.pauses), default=0.0), 2),
                "gc_gen2_pauses": sum(1 for *_, g in self.pauses if g == 2)}
