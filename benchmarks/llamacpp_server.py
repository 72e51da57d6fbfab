"""llama.cpp's C++ `llama-server` for the CPU comparison: found, or built from the llama.cpp sources that PyPI's
llama-cpp-python sdist vendors, and its command line.

The build is llama.cpp's own CMake build of the one target, for this CPU (`GGML_NATIVE`), static, without the
web UI, TLS or tests, at low priority on two jobs: a loaded machine stays usable while it compiles (about
20 minutes on two cores). It lands in `<cache>/llama.cpp-<version>/build/bin/llama-server` and is reused.

llama-server runs with continuous batching over `slots` parallel slots of `slot_ctx` tokens each, and with
ggml's extra weight buffer types off (`--no-repack`, which sets llama.cpp's `use_extra_bufts = false`, as the
Python fallback does through its model params): on a CPU with AMX those buffers send Q4_1 weights to ggml's
AMX kernels, and llama-server built from this sdist (GGML_NATIVE, so with AMX) dies of SIGSEGV while loading
the default model's Q4_1 file with them, where it answers "Paris." without. Weight repacking, the other extra
buffer type, has no Q4_1 form, so on that file the flag changes nothing else; `extra_bufts=True` keeps them.

llama-cpp-python's Python server (`llama_cpp.server`) is the fallback only where no llama-server can be had: it
serves one request at a time, so its concurrent-stream figures are not llama.cpp's.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import NamedTuple

SDIST_VERSION = "0.3.36"            # llama-cpp-python's sdist whose vendor/llama.cpp is built
CMAKE_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON",
                 "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_CURL=OFF"]
# llama_cpp.server with ggml's extra weight buffer types off, as --no-repack does for llama-server.
PYTHON_NO_EXTRA_BUFTS = """import sys, llama_cpp.llama_cpp as C
default = C.llama_model_default_params
def params():
    p = default(); p.use_extra_bufts = False; return p
C.llama_model_default_params = params
from llama_cpp.server.__main__ import main
sys.argv[0] = "llama_cpp.server"; main()
"""


class LlamaCpp(NamedTuple):
    kind: str                       # "server": the C++ llama-server; "python": llama_cpp.server
    path: str                       # the llama-server binary, or the python that runs llama_cpp.server
    description: str                # what it is and where it came from, for the run's header


def server_version(binary: str) -> str | None:
    """llama-server's version ("0.5.0-dev (build 0, commit unknown)"), or None when the binary does not run."""
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version: (.*)", r.stdout + r.stderr)
    return m.group(1).strip() if r.returncode == 0 and m else None


def python_version(python: str) -> str | None:
    """The llama-cpp-python version that `python` imports with its server, or None."""
    try:
        r = subprocess.run([python, "-c", "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)"],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def build_server(cache_dir: Path, version: str = SDIST_VERSION) -> tuple[str | None, str]:
    """Downloads llama-cpp-python's sdist with pip, builds its vendored llama.cpp's llama-server; returns
    (binary, how) or (None, why not). Each step's output goes to one log, whose tail the reason quotes."""
    root = cache_dir / f"llama.cpp-{version}"
    binary = root / "build" / "bin" / "llama-server"
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    print(f"building llama-server from llama-cpp-python {version}'s sdist into {root} (minutes; log {log})",
          flush=True)
    with open(log, "ab") as f:
        def step(argv: list[str]) -> bool:
            f.write(("\n$ " + " ".join(argv) + "\n").encode())
            f.flush()
            return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode == 0

        src = root / "src"
        sdists = sorted((root / "sdist").glob(f"llama_cpp_python-{version}.tar.gz"))
        if not sdists:
            if not step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                         f"llama-cpp-python=={version}", "-d", str(root / "sdist")]):
                return None, _why("pip download of llama-cpp-python's sdist failed", log)
            sdists = sorted((root / "sdist").glob(f"llama_cpp_python-{version}.tar.gz"))
        if not (src / "CMakeLists.txt").exists():
            shutil.rmtree(src, ignore_errors=True)
            try:
                with tarfile.open(sdists[0]) as tar:
                    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
                    members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
                    for m in members:
                        m.name = m.name[len(prefix):]
                    tar.extractall(src, members=[m for m in members if m.name], filter="data")
            except (OSError, tarfile.TarError, IndexError) as exc:
                for bad in sdists:                      # fetched again by the next run
                    bad.unlink(missing_ok=True)
                return None, f"could not unpack {sdists[0] if sdists else 'the sdist'}: {' '.join(str(exc).split())}"
            if not (src / "CMakeLists.txt").exists():
                return None, f"{sdists[0].name} vendors no llama.cpp (no vendor/llama.cpp/CMakeLists.txt)"
        if shutil.which("cmake") is None:
            return None, "no cmake on PATH to build llama-server with"
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        if not step([*nice, "cmake", "-S", str(src), "-B", str(root / "build"), *CMAKE_OPTIONS]):
            return None, _why("cmake could not configure llama.cpp", log)
        if not step([*nice, "cmake", "--build", str(root / "build"), "--target", "llama-server", "-j2"]):
            return None, _why("llama-server did not compile", log)
    found = server_version(str(binary))
    if found is None:
        return None, _why(f"the built {binary} does not run", log)
    return str(binary), f"llama-server {found} (built from llama-cpp-python {version}'s sdist: {binary})"


def _why(what: str, log: Path) -> str:
    tail = " | ".join(log.read_text(errors="replace").splitlines()[-3:])
    return f"{what} (log {log}): {tail[-300:]}"


def find_llama_cpp(server: str | None, python: str | None, cache_dir: Path,
                   no_build: bool) -> tuple[LlamaCpp | None, str]:
    """llama.cpp to compare against: `server` (a llama-server binary) if named, else the one built before under
    `cache_dir`, else one built now; llama_cpp.server under `python` only where no llama-server can be had.
    (None, why) when there is neither."""
    from mii_async.errors import InvalidParameterError

    if server:
        found = server_version(server)
        if found is None:
            raise InvalidParameterError("llama_server", f"{server} does not run (`{server} --version` failed)")
        return LlamaCpp("server", server, f"llama-server {found} ({server})"), ""
    built = cache_dir / f"llama.cpp-{SDIST_VERSION}" / "build" / "bin" / "llama-server"
    if built.exists() and (found := server_version(str(built))):
        return LlamaCpp("server", str(built), f"llama-server {found} ({built})"), ""
    if no_build:
        why = f"no llama-server in {built} (--llama-server BIN names one; --no-build forbids building it)"
    else:
        path, why = build_server(cache_dir)
        if path is not None:
            return LlamaCpp("server", path, why), ""
    if python:
        found = python_version(python)
        if found is None:
            raise InvalidParameterError("llama_python", f"{python} cannot import llama_cpp.server")
        return LlamaCpp("python", python, f"llama-cpp-python {found}'s Python server ({python}), one request "
                                          f"at a time: no llama-server ({why})"), ""
    return None, why


def server_argv(llama: LlamaCpp, gguf: str, threads: int, slots: int, slot_ctx: int, extra_bufts: bool,
                extra: list[str]) -> list[str]:
    """The command line that serves `gguf` on 127.0.0.1, its port left as "{port}". llama-server gets `slots`
    parallel slots (continuous batching) and a context of slots × slot_ctx (in 256s), split evenly among them;
    the Python server serves one request at a time in a slot_ctx context."""
    t = str(threads)
    if llama.kind == "server":
        per_slot = -(-slot_ctx // 256) * 256            # llama.cpp pads each slot's context to 256s itself
        return [llama.path, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-t", t, "-tb", t,
                "-c", str(slots * per_slot), "-np", str(slots), "--cont-batching",
                *([] if extra_bufts else ["--no-repack"]), *extra]
    # --interrupt_requests False: otherwise a new request cuts the streaming one short.
    entry = ["-m", "llama_cpp.server"] if extra_bufts else ["-c", PYTHON_NO_EXTRA_BUFTS]
    return [llama.path, *entry, "--model", gguf, "--host", "127.0.0.1", "--port", "{port}", "--n_threads", t,
            "--n_threads_batch", t, "--n_ctx", str(slot_ctx), "--interrupt_requests", "False", *extra]


def request_fields() -> dict[str, object]:
    """llama.cpp's own request fields, sent beside the OpenAI ones, for greedy decoding of exactly the tokens
    asked: temperature 0 is already greedy (an argmax) there, and `max_tokens` is llama-server's alias of its
    `n_predict`; `ignore_eos` (sent by the bench already) is its own field, which masks every end token; the
    repeat penalty is off (1.0), which llama-cpp-python's server does not default to (1.1)."""
    return {"repeat_penalty": 1.0, "ignore_eos": True}
