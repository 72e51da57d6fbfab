"""The CPU engine's plan (workers/cpu_plan.py): a worker's OpenMP wait policy unless the environment sets one,
threads shared among a host's tensor-parallel ranks, a batch-1 decode step on every thread while the CPUs are
free and on one while other processes keep them busy, and the plan line naming the choice."""
from __future__ import annotations

import torch
from mii_async.workers.cpu_plan import (
    FreeCPUs,
    StepThreads,
    apply_threads,
    cpu_count,
    describe,
    set_worker_wait_policy,
)


def test_wait_is_a_short_spin_unless_the_environment_says():
    env: dict[str, str] = {}
    assert set_worker_wait_policy(env) == "spin 10000, then sleep" and env == {"GOMP_SPINCOUNT": "10000"}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert set_worker_wait_policy(env) == "passive" and "GOMP_SPINCOUNT" not in env
    env = {"GOMP_SPINCOUNT": "0"}
    assert set_worker_wait_policy(env) == "spin 0, then sleep" and env == {"GOMP_SPINCOUNT": "0"}


def test_threads_follow_the_cpus_and_the_ranks():
    before = torch.get_num_threads()
    try:
        assert apply_threads(3) == 3 and torch.get_num_threads() == 3
        assert apply_threads(None, ranks=cpu_count() + 1) == 1          # at least one each
        assert apply_threads(None) == cpu_count()
    finally:
        torch.set_num_threads(before)


class Fixed:
    def __init__(self, free: float) -> None:
        self.free = free

    def __call__(self) -> float:
        return self.free


def test_a_batch_1_decode_step_takes_every_thread_only_while_the_cpus_are_free():
    before = torch.get_num_threads()
    free = Fixed(2.0)
    try:
        torch.set_num_threads(2)
        steps = StepThreads(2, free)
        steps(1)
        assert torch.get_num_threads() == 2
        free.free = 1.2                          # another process keeps most of a CPU busy
        steps(1)
        assert torch.get_num_threads() == 1
        steps(16)
        assert torch.get_num_threads() == 2
        free.free = 1.6
        steps(1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_free_cpus_see_another_process_busy():
    """A busy child process lowers the free CPUs the monitor reports; this process's own work does not."""
    import subprocess
    import sys
    import time

    probe = FreeCPUs(cpu_count())
    probe.WINDOW_S = 0.5
    probe()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:                # this process busy: not counted
        pass
    assert probe() > cpu_count() - 0.5
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.5)
        probe()
        time.sleep(1.0)
        assert probe() <= cpu_count() - 0.5
    finally:
        child.kill()
        child.wait()


def test_the_plan_line_names_weights_threads_and_why():
    line = describe("bfloat16", "int4", "kept at 4 bits", 2)
    assert line.startswith("cpu plan: int4 projections") and "bfloat16 activations (kept at 4 bits)" in line
    assert "2 threads of" in line and "a batch-1 decode step on one while other processes keep them busy" in line
    assert describe("float32", None, "as asked", 1).startswith("cpu plan: float32 weights")
    assert "native CPU ops" in describe("bfloat16", "int4", "kept", 2, "cpu", "auto")
    assert "the torch reference ops (as asked)" in describe("bfloat16", "int4", "kept", 2, "reference", "reference")
