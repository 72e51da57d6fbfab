"""How a CPU engine runs: its weights' scheme, its threads and how they wait, and the line that says so at start.

Weights. A GGUF model whose projections are stored in 4 bits or fewer (the default model's file is Q4_1) is
served from 4-bit weights (`quantization="int4"`, kernels/int_weight.py), as llama.cpp serves the same file:
a batch-1 decode step streams the weights once, and 4-bit weights are an eighth of the fp32 bytes the file
expands to. Only when nothing was asked for: a named `dtype` or `quantization` is followed as given, and an HF
directory keeps its own precision.

Threads. One intra-op thread per CPU this process may run on (its affinity mask; shared among the ranks of a
tensor-parallel replica), or `threads` when given; a batch-1 decode step runs on one (StepThreads).
Worker processes wait passively between parallel regions (OMP_WAIT_POLICY=PASSIVE unless the environment sets
it; workers/main.py, before torch loads): a decode step holds hundreds of regions, and threads that spin at
each barrier take the cores from the router, the gateway and the clients beside them: on a busy 2-core machine
two spinning threads made a step 3-6x slower than one thread, where two passive ones stayed within 10% of it.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
WORKER_WAIT_POLICY = "PASSIVE"
# GGUF tensor types of 4 bits or fewer a weight (ggml's names): served as int4 rather than expanded to fp32
LOW_BIT_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS",
                           "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"})
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TYPES_FILE = "gguf_projection_types.json"      # in a converted model's directory: projection_types' answer


def set_worker_wait_policy(environ: dict[str, str] = os.environ) -> str:  # noqa: B006 (the process's own)
    """A worker's OpenMP wait policy, set before torch loads (libgomp reads it once); the environment's wins."""
    return environ.setdefault(WAIT_POLICY_ENV, WORKER_WAIT_POLICY)


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


class StepThreads:
    """The threads of each CPU step: one for a batch-1 decode step, `threads` for the others. A one-token step's
    GEMMs are small, each a fork and join across the team: on a quiet 2-core machine the default model's int4
    batch-1 step took 20.8 ms on one thread against 25.5 ms on two passive ones (the output head alone takes
    every thread: kernels/cpu.py); served, with the router, gateway and client on the same cores, two threads
    that spin briefly between GEMMs lost too (37-40 against 42 tok/s), while a 16-row step gains from the
    second thread."""

    SINGLE_THREAD_TOKENS = 1

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.current = threads

    def __call__(self, tokens: int) -> None:
        import torch

        want = 1 if tokens <= self.SINGLE_THREAD_TOKENS else self.threads
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


def projection_types(gguf: Path, model_path: Path | None = None) -> set[str]:
    """The GGUF tensor types of the attention and MLP projections. gguf's reader parses every metadata field on
    the way to the tensors (the default model's 49,152-token vocabulary: about 3 s, most of a cold start), so a
    converted model's directory (named for the file's fingerprint) keeps the answer in TYPES_FILE after the first
    time it is asked."""
    cached = model_path / TYPES_FILE if model_path is not None else None
    if cached is not None:
        try:
            return set(json.loads(cached.read_text())["projection_types"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    types = {t.tensor_type.name for t in reader.tensors if any(f".{p}." in t.name for p in PROJECTIONS)}
    if cached is not None:
        try:                            # written whole under a temporary name: a reader never sees half of it
            fd, tmp = tempfile.mkstemp(dir=model_path, prefix=f".{TYPES_FILE}.")
            with os.fdopen(fd, "w") as f:
                json.dump({"source": str(gguf), "projection_types": sorted(types)}, f)
            os.replace(tmp, cached)
        except OSError:
            pass                        # a read-only cache: asked again next start
    return types


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
    types = projection_types(source, model_path)
    if types and types <= LOW_BIT_TYPES:
        return "int4", f"{source.name} holds its projections in {'/'.join(sorted(types))}: kept at 4 bits"
    return None, f"{source.name} holds its projections in {'/'.join(sorted(types)) or 'no known type'}"


def kernels_phrase(kernels: str, asked: str, quantization: str | None = None) -> str:
    """How the plan names the op set: the native ops (kernels/cpu.py) and which GEMMs are theirs, or the
    reference and why."""
    if kernels == "cpu":
        if quantization != "int4":
            return "native CPU ops (built for this CPU) between torch's GEMMs"
        from mii_async.kernels.cpu_build import load

        lib = load()
        if lib is not None and lib.int4_gemm_native():
            return ("native CPU ops and int4 / int8 GEMMs (built for this CPU; AVX512-BF16 dot products), a "
                    "one-thread decode step's layers in one call")
        return "native CPU ops (built for this CPU) between torch's int4 GEMMs (no AVX512-BF16 here)"
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
    return (f"cpu plan: {weights}, {dtype} activations ({why}); {threads} threads of {cpu_count()} CPUs (one for "
            f"a batch-1 decode step), OpenMP "
            f"waits {os.environ.get(WAIT_POLICY_ENV, 'as libgomp defaults (spin, then sleep)').lower()}; "
            f"{kernels_phrase(kernels, asked, quantization)}; CPU: {isa or 'no AVX2/AVX-512'}")
