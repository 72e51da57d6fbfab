"""StepLog: the wall time of every engine step of a run, the plan it ran, and the garbage collector's pauses in
it, so that the slowest steps of a benchmark (its ITL tail) can be told apart: a long GPU step, or the host
stalled by a collection; and so that a step's time can be read against what it computed (tokens, decodes, the
decodes' context) and, with `launched`, against the host's time to launch its plan and the GPU's time from the
plan's first kernel to its last (a wall time far above its GPU time is the host's, or a wait on something else)."""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

# Step sizes (scheduled tokens) by which `summary` groups the steps.
TOKEN_BUCKETS = (0, 64, 256, 512, 1024, 1536, 2048)


@dataclass
class StepLog:
    steps: list[tuple[float, float, int]] = field(default_factory=list)   # (start s, seconds, outputs)
    pauses: list[tuple[float, float, int]] = field(default_factory=list)  # (start s, seconds, generation)
    plans: list[tuple[int, int, int]] = field(default_factory=list)       # (decodes, tokens, decode context)
    lag: int = 0                  # the plan a step's wall time waits on: 1 with async scheduling (the last one)
    # counters read around every step (e.g. the CUDA allocator's retries and cudaMallocs): the slowest steps
    # show what moved in them, the summary the totals over the run
    counters: Callable[[], dict[str, int]] | None = None
    moved: list[dict[str, int]] = field(default_factory=list)
    # per plan, as launched: (host seconds, start event, end event); events have `elapsed_time(end)` in ms
    # (torch.cuda.Event), read at `summary`, once the run is over
    launches: list[tuple[float, Any, Any]] = field(default_factory=list)
    parts: list[dict[str, float]] = field(default_factory=list)  # per launch: host seconds by part, if given
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
        before = self.counters() if self.counters else None
        a = time.perf_counter()
        outs = fn()
        self.steps.append((a - self._t0, time.perf_counter() - a, len(outs)))
        if before is not None:
            after = self.counters()
            self.moved.append({k: after[k] - v for k, v in before.items() if after[k] != v})
        return outs

    def plan(self, decodes: int, tokens: int, decode_context: int) -> None:
        """Records the plan the current step launches (call it from the scheduler's `schedule`)."""
        self.plans.append((decodes, tokens, decode_context))

    def launched(self, host_seconds: float, start: Any, end: Any, parts: dict[str, float] | None = None) -> None:
        """Records how the current plan was launched: the host's seconds in it, events recorded on the GPU's
        stream before its first kernel and after its last (one call per `plan`, in the same order), and
        optionally where the host's seconds went (part → seconds)."""
        self.launches.append((host_seconds, start, end))
        self.parts.append(dict(parts or {}))

    def _parts_ms(self, j: int) -> dict[str, float]:
        return {f"{k}_ms": round(1e3 * v, 2) for k, v in self.parts[j].items()} if j < len(self.parts) else {}

    def _launch_of(self, i: int) -> tuple[float, float] | None:
        """(host ms, GPU ms) of the plan step `i` waited on."""
        j = i - self.lag
        if not 0 <= j < len(self.launches):
            return None
        host, start, end = self.launches[j]
        return 1e3 * host, start.elapsed_time(end)

    def _plan_of(self, i: int) -> tuple[int, int, int] | None:
        j = i - self.lag
        return self.plans[j] if 0 <= j < len(self.plans) else None

    def summary(self, slowest: int = 10) -> dict:
        """The slowest steps (ms, outputs, the GC pause ms inside each, and their plans when recorded), the
        collector's totals, and with plans, the steps grouped by size: count, ms, decodes and their context."""
        def gc_in(start: float, secs: float) -> float:
            return sum(d for t, d, _ in self.pauses if start <= t < start + secs)

        order = sorted(range(len(self.steps)), key=lambda i: -self.steps[i][1])[:slowest]
        ms = sorted(1e3 * d for _, d, _ in self.steps)
        top = []
        for i in order:
            t, d, n = self.steps[i]
            row = {"at_s": round(t, 3), "ms": round(1e3 * d, 2), "outputs": n, "gc_ms": round(1e3 * gc_in(t, d), 2)}
            if (p := self._plan_of(i)) is not None:
                row.update(decodes=p[0], tokens=p[1], decode_context=p[2])
            if (la := self._launch_of(i)) is not None:
                row.update(launch_host_ms=round(la[0], 2), gpu_ms=round(la[1], 2))
            if self.lag and i < len(self.launches):   # the launch this step made while the plan ran
                row["own_launch_host_ms"] = round(1e3 * self.launches[i][0], 2)
                row.update({f"own_{k}": v for k, v in self._parts_ms(i).items()})
            if self.moved:
                row["counters"] = self.moved[i]
            top.append(row)
        out = {"steps": len(self.steps),
               "step_ms_p50": ms[len(ms) // 2] if ms else 0.0,
               "step_ms_p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else 0.0,
               "slowest_steps": top,
               "gc_pauses": len(self.pauses), "gc_ms_total": round(1e3 * sum(d for _, d, _ in self.pauses), 2),
               "gc_ms_max": round(1e3 * max((d for _, d, _ in self.pauses), default=0.0), 2),
               "gc_gen2_pauses": sum(1 for *_, g in self.pauses if g == 2)}
        if self.launches:
            out["slowest_launches"] = self._slowest_launches(slowest)
        if self.plans:
            out["by_tokens"] = self._by_tokens()
            out["timeline"] = self._timeline()
        if self.moved:
            totals: dict[str, int] = {}
            for m in self.moved:
                for k, v in m.items():
                    totals[k] = totals.get(k, 0) + v
            out["counters_total"] = totals
            out["steps_moving_counters"] = sum(1 for m in self.moved if m)
        return out

    def _slowest_launches(self, n: int) -> list[dict]:
        """The launches that took the host longest: the plan, host and GPU ms, and the host's parts."""
        order = sorted(range(len(self.launches)), key=lambda j: -self.launches[j][0])[:n]
        rows = []
        for j in order:
            host, start, end = self.launches[j]
            row: dict = {"launch": j, "host_ms": round(1e3 * host, 2), "gpu_ms": round(start.elapsed_time(end), 2)}
            if j < len(self.plans):
                row.update(decodes=self.plans[j][0], tokens=self.plans[j][1])
            row.update(self._parts_ms(j))
            rows.append(row)
        return rows

    def _timeline(self, window: float = 1.0) -> list[list[float]]:
        """Per `window` seconds of the run: [start s, steps, step ms mean, decodes mean, tokens mean]."""
        rows: dict[int, list[float]] = {}
        for i, (t, d, _) in enumerate(self.steps):
            if (p := self._plan_of(i)) is None:
                continue
            r = rows.setdefault(int(t // window), [0, 0.0, 0, 0])
            r[0] += 1
            r[1] += d
            r[2] += p[0]
            r[3] += p[1]
        return [[k * window, n, round(1e3 * d / n, 2), round(dec / n, 1), round(tok / n, 1)]
                for k, (n, d, dec, tok) in sorted(rows.items())]

    def _by_tokens(self) -> list[dict]:
        groups: dict[int, list[tuple[float, tuple[int, int, int], tuple[float, float] | None]]] = {}
        for i, (_, d, _) in enumerate(self.steps):
            if (p := self._plan_of(i)) is None:
                continue
            lo = max(b for b in TOKEN_BUCKETS if b <= p[1])
            groups.setdefault(lo, []).append((d, p, self._launch_of(i)))
        rows = []
        for lo in sorted(groups):
            g = groups[lo]
            n = len(g)
            row = {"tokens_from": lo, "steps": n, "ms_mean": round(1e3 * sum(d for d, *_ in g) / n, 2),
                   "seconds": round(sum(d for d, *_ in g), 2),
                   "tokens_mean": round(sum(p[1] for _, p, _ in g) / n, 1),
                   "decodes_mean": round(sum(p[0] for _, p, _ in g) / n, 1),
                   "decode_context_mean": round(sum(p[2] for _, p, _ in g) / max(1, sum(p[0] for _, p, _ in g)), 1)}
            timed = [la for *_, la in g if la is not None]
            if timed:
                gpu = sorted(la[1] for la in timed)
                row.update(launch_host_ms_mean=round(sum(la[0] for la in timed) / len(timed), 2),
                           gpu_ms_mean=round(sum(gpu) / len(gpu), 2), gpu_ms_max=round(gpu[-1], 2))
            rows.append(row)
        return rows
