"""drain: the benchmarks' way to run a workload on an in-process engine — every request submitted at once, the
engine stepped until all finish, each token's time taken when the engine hands it over (as a worker sends it)."""
from __future__ import annotations

import time

import torch

import mii_async

from .step_log import StepLog


def drain(engine, reqs: list[tuple[list[int], int]], start_id: int = 0, log: StepLog | None = None,
          early: bool = True) -> tuple[float, dict[int, list[float]]]:
    """Submits every (prompt, output length) at once and steps until all finish; returns the wall time and
    each request's token times (seconds from the start). With `log`, each step is timed there. `early`: the
    engine hands tokens over as soon as they are read (`step(emit)`, as a worker does), not at the step's end."""
    times: dict[int, list[float]] = {}
    for i, (p, n) in enumerate(reqs):
        engine.add_request(start_id + i, p, mii_async.SamplingParams(max_new_tokens=n, ignore_eos=True))
        times[start_id + i] = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()

    def emit(outs) -> None:           # a token's time is when the engine hands it over, as a worker sends it
        now = time.perf_counter() - t0
        for out in outs:
            times[out.req_id].append(now)

    handed: list = []                 # this step's tokens handed over early, for the step log's count

    def hand_over(outs) -> None:
        emit(outs)
        handed.extend(outs)

    def step() -> list:
        handed.clear()
        outs = engine.step(hand_over if early else None)
        emit(outs)
        return handed + outs

    while engine.has_work():
        step() if log is None else log.step(step)
    return time.perf_counter() - t0, times
