"""The CPU backend's native library: the C files of csrc/cpu/ (the fused small ops, the int4 and int8 GEMMs,
the one-call decode step) compiled into one shared object for this machine's CPU at first use, loaded with ctypes.

The source is compiled with the host's C compiler (`$CC`, else cc, gcc or clang) and `-march=native`, so the
vector instructions are those this CPU has (AVX-512, AVX2, NEON, or none); the shared object is cached
under the user's cache directory, keyed by the sources, the compiler's flags and the CPU's model and flags, so a
second start loads it in milliseconds and a changed CPU or source builds anew. Without a compiler (a slim
container) `load()` returns None and the engine runs the torch reference instead, saying why in its plan line.

Compiled with `-fno-math-errno -fno-trapping-math -fassociative-math -fno-signed-zeros`: the reductions of the
attention and norm loops vectorize only when the compiler may reorder float sums; NaN and infinity keep their
meaning (no -ffast-math).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCES = tuple(Path(__file__).parent / "csrc" / "cpu" / name
                for name in ("cpu_ops.c", "int4_gemm.c", "int8_gemm.c", "decode_layers.c"))
HEADERS = tuple(Path(__file__).parent / "csrc" / "cpu" / name for name in ("bf16.h", "team.h"))
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros")
ENV_DISABLE = "MII_ASYNC_CPU_KERNELS"   # "0": never build or load the library (the torch reference runs)

P, I, I64, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "add_rms_norm": [P, P, P, P, F, I, I, I, P],
    "gated_act": [P, I, I, I, I, P],
    "rotary_write_kv": [P, P, P, P, I64, I64, I64, P, I64, I, I, I, I, I, P, P, I64, P, P],
    "decode_attention": [P, P, P, I64, P, I, P, I, I, I, I, I, I, F, I, F, I, P, P, I],
    "int4_gemm": [P, P, I, I, P, I, P, I, I, P, I],
    "int4_gemm_native": [],
    "int8_gemm": [P, P, I, I, P, I, I, P, I, I, P, I],
    "int8_gemm_native": [],
    "decode_layers": [P, P, I, P, P, P, I, P, P, P],
}
# int: 0, -1 out of memory, -2 an index out of range, -3 not built for this CPU; int4_gemm_native: 1 or 0
RETURNS_STATUS = ("add_rms_norm", "decode_attention", "rotary_write_kv", "int4_gemm", "int4_gemm_native",
                  "int8_gemm", "int8_gemm_native", "decode_layers")

_lock = threading.Lock()
_state: dict[str, object] = {}


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_identity() -> str:
    """The CPU's model name and flags: what -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:8192]
    except OSError:
        import platform

        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mii_async" / "cpu_kernels"


def build(cc: str, out_dir: Path) -> Path:
    """Compiles the sources into out_dir (an existing build of the same key is reused). Raises OSError or
    subprocess.CalledProcessError when the compiler fails."""
    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS) + " ".join((cc, *FLAGS)).encode()
                         + _cpu_identity().encode())
    target = out_dir / f"cpu_ops-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The library, built if need be; None where it cannot be (why: `unavailable_reason()`). Once per process."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib, why = None, ""
        cc = compiler()
        if os.environ.get(ENV_DISABLE) == "0":
            why = f"{ENV_DISABLE}=0"
        elif cc is None:
            why = "no C compiler (cc, gcc or clang) on PATH"
        else:
            try:
                lib = ctypes.CDLL(str(build(cc, cache_dir())))
                for name, args in SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, (ctypes.c_int if name in RETURNS_STATUS else None)
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", None) or str(exc)
                lib, why = None, f"{cc} could not build {', '.join(s.name for s in SOURCES)}: {detail.strip()[:300]}"
        _state["lib"], _state["why"] = lib, why
        return lib


def unavailable_reason() -> str:
    load()
    return str(_state.get("why", ""))
