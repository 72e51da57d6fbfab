"""How a CPU engine runs: its weights' scheme, its threads and how they wait, and the line that says so at start.

Weights. A GGUF model whose projections are stored in 4 bits or fewer (the default model's file is Q4_1) is
served from 4-bit weights (`quantization="int4"`, kernels/int_weight.py), as llama.cpp serves the same file:
a batch-1 decode step streams the weights once, and 4-bit weights are an eighth of the fp32 bytes the file
expands to. Only when nothing was asked for: a named `dtype` or `quantization` is followed as given, and an HF
directory keeps its own precision.

Threads. One intra-op thread per CPU this process may run on (its affinity mask; shared among the ranks of a
tensor-parallel replica), or `threads` when given. A batch-1 decode step takes them all while the CPUs are free of
other work, and one while they are not (StepThreads, FreeCPUs): its GEMMs are small, so each is a fork and join,
cheap when the team's threads find free cores and costly when they wait for one.
Worker processes spin briefly at the end of a parallel region, then sleep (GOMP_SPINCOUNT=10000, unless the
environment sets it or OMP_WAIT_POLICY; workers/main.py, before torch loads): the next GEMM of a step comes within
microseconds and finds its threads awake, while idle threads leave the cores to the router, the gateway and the
clients beside them. Measured on a 2-core machine, default model, int4, batch-1 step: 16.9 ms on two threads
spinning 10000 against 25.6 ms on two passive ones and 21.4 on one; with two busy processes beside it, 34–39 ms
on one thread against 54–61 on two, hence the fall back to one.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_ENV = "GOMP_SPINCOUNT"
WORKER_SPINCOUNT = "10000"         # libgomp's spin iterations before a thread sleeps: tens of microseconds
# GGUF tensor types of 4 bits or fewer a weight (ggml's names): served as int4 rather than expanded to fp32
LOW_BIT_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS",
                           "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"})
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def set_worker_wait_policy(environ: dict[str, str] = os.environ) -> str:
    """A worker's OpenMP wait, set before torch loads (libgomp reads it once): a short spin, then sleep, unless
    the environment names a policy or a spin count. Returns how the plan line names it."""
    if WAIT_POLICY_ENV not in environ:
        environ.setdefault(SPIN_ENV, WORKER_SPINCOUNT)
    return wait_phrase(environ)


def wait_phrase(environ: dict[str, str] = os.environ) -> str:
    if WAIT_POLICY_ENV in environ:
        return environ[WAIT_POLICY_ENV].lower()
    if SPIN_ENV in environ:
        return f"spin {environ[SPIN_ENV]}, then sleep"
    return "as libgomp defaults (spin, then sleep)"


def cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                       # not Linux
        return os.cpu_count() or 1


def apply_threads(requested: int | None, ranks: int = 1) -> int:
    """Sets torch's intra-op threads: `requested`, else the CPUs this process may run on shared among the
    `ranks` tensor-parallel processes of one host (at least one each)."""
    import torch
    from mii_async.kernels.cpu import set_head_threads

    n = requested or max(1, cpu_count() // ranks)
    torch.set_num_threads(n)
    set_head_threads(n)
    return n


class FreeCPUs:
    """How many of this process's CPUs other processes left free over the last WINDOW_S seconds: the host's busy
    time (/proc/stat) less this process's own (os.times), per second of wall time. Where /proc/stat cannot be
    read, every CPU counts as free."""

    WINDOW_S = 1.0

    def __init__(self, cpus: int) -> None:
        self.cpus = cpus
        self.free = float(cpus)
        self._last: tuple[float, float, float] | None = None
        self._host = os.cpu_count() or cpus
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = (sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / self._tick
        own = os.times()
        return time.monotonic(), busy, own.user + own.system

    def __call__(self) -> float:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.WINDOW_S:
            return self.free
        sample = self._sample()
        if sample is None:
            return self.free
        if self._last is not None:
            wall = sample[0] - self._last[0]
            others = max(0.0, (sample[1] - self._last[1]) - (sample[2] - self._last[2])) / wall
            self.free = max(0.0, min(float(self.cpus), self._host - others))
        self._last = sample
        return self.free


class StepThreads:
    """The threads of each CPU step: `threads` for a step of several tokens; for a batch-1 decode step too while
    the CPUs are free (FreeCPUs: at least threads - 1/2 of them), else one."""

    SINGLE_THREAD_TOKENS = 1

    def __init__(self, threads: int, free: FreeCPUs | None = None) -> None:
        self.threads = threads
        self.current = threads
        self.free = free or FreeCPUs(threads)

    def __call__(self, tokens: int) -> None:
        import torch

        want = self.threads
        if tokens <= self.SINGLE_THREAD_TOKENS and self.threads > 1 and self.free() < self.threads - 0.5:
            want = 1
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where that cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def gguf_source(model_path: Path) -> Path | None:
    """The GGUF file a converted model directory was made from (model_source.convert_gguf's done.json)."""
    try:
        source = json.loads((model_path / "done.json").read_text()).get("source")
    except (OSError, ValueError):
        return None
    return Path(source) if source and Path(source).is_file() else None


def projection_types(gguf: Path) -> set[str]:
    """The GGUF tensor types of the attention and MLP projections."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    return {t.tensor_type.name for t in reader.tensors if any(f".{p}." in t.name for p in PROJECTIONS)}


def auto_quantization(model: str | None, model_path: Path, dtype: str, quantization: str | None) -> tuple[str | None, str]:
    """The CPU weights' scheme when none was asked for, and why: int4 for a GGUF model (the default one, or a
    .gguf file) whose projections are stored in 4 bits or fewer; else as asked (or the model's own dtype)."""
    if quantization is not None or dtype != "auto":
        return quantization, "as asked"
    if model is not None and not str(model).endswith(".gguf"):
        return None, "the model directory's own weights"
    source = gguf_source(model_path)
    if source is None:
        return None, "the converted weights"
    types = projection_types(source)
    if types and types <= LOW_BIT_TYPES:
        return "int4", f"{source.name} holds its projections in {'/'.join(sorted(types))}: kept at 4 bits"
    return None, f"{source.name} holds its projections in {'/'.join(sorted(types)) or 'no known type'}"


def kernels_phrase(kernels: str, asked: str) -> str:
    """How the plan names the op set: the native ops (kernels/cpu.py), or the reference and why."""
    if kernels == "cpu":
        return "native CPU ops (built for this CPU) between torch's GEMMs"
    if asked != "auto":
        return "the torch reference ops (as asked)"
    from mii_async.kernels.cpu_build import unavailable_reason

    return f"the torch reference ops ({unavailable_reason()})"


def describe(dtype: str, quantization: str | None, why: str, threads: int, kernels: str = "reference",
             asked: str = "reference") -> str:
    """The plan's line for a CPU engine."""
    flags = cpu_flags()
    isa = ", ".join(name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"),
                                            ("amx_bf16", "AMX-BF16"), ("avx2", "AVX2")) if flag in flags)
    weights = {"int4": "int4 projections (groups of 32) and an int8 head",
               "fp8": "FP8 projections (dequantized per op)"}.get(quantization or "", f"{dtype} weights")
    return (f"cpu plan: {weights}, {dtype} activations ({why}); {threads} threads of {cpu_count()} CPUs (a batch-1 "
            f"decode step on one while other processes keep them busy), OpenMP "
            f"waits {wait_phrase()}; "
            f"{kernels_phrase(kernels, asked)}; CPU: {isa or 'no AVX2/AVX-512'}")
