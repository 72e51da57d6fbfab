"""Tensor parallelism through the mesh: peak memory per rank, wall time, plan-broadcast cost, per degree.

    python -m benchmarks.tp_memory [--degrees 1 3] [--requests 16] [--new-tokens 32] [--model M]

Each degree is a fresh deployment (`serve(tensor_parallel=T)`); every request streams exactly --new-tokens
tokens (`ignore_eos`), and the outputs of every degree must equal those of the first.
"""
from __future__ import annotations

import argparse
import time

import mii_async


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--degrees", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-cache-memory", type=float, default=0.05)
    a = ap.parse_args(argv)
    prompts = [[1] + [100 + i] * 40 for i in range(a.requests)]
    rows, first = [], None
    for t in a.degrees:
        client = mii_async.serve(a.model, tensor_parallel=t, kv_cache_memory=a.kv_cache_memory)
        try:
            health = client.run(client.health())
            client(prompts[:1], max_new_tokens=2, ignore_eos=True)               # warm-up
            t0 = time.perf_counter()
            out = client(prompts, max_new_tokens=a.new_tokens, ignore_eos=True)
            seconds = time.perf_counter() - t0
            stats = client.run(client.stats())
        finally:
            client.terminate_server_sync(drain_s=0)
        ids = [r.token_ids for r in out]
        assert all(len(x) == a.new_tokens for x in ids), "a request streamed fewer tokens than asked"
        first = first or ids
        rows.append({"tensor_parallel": t, "peak_rss_mib": health["replicas"][0]["peak_rss_mib"],
                     "seconds": seconds, "same_outputs_as_first": ids == first,
                     "plan_broadcast_us_per_step": stats.get("tp_plan_broadcast_us_per_step")})
    print("| tensor_parallel | peak RSS per rank (MiB) | seconds | plan broadcast µs/step | outputs = first |")
    print("|---:|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['tensor_parallel']} | {', '.join(map(str, r['peak_rss_mib']))} | {r['seconds']:.2f} | "
              f"{r['plan_broadcast_us_per_step'] or '—'} | {r['same_outputs_as_first']} |")
    return rows


if __name__ == "__main__":
    main()
