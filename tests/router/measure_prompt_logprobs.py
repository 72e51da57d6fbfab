"""What one request's prompt logprobs cost each process on their way (not a test: a measurement, run by hand).

    python -m tests.router.measure_prompt_logprobs [--positions 100000 --n 1] [--positions 10000 --n 20]

For a prompt of `positions` + 1 tokens with prompt_logprobs=n, on random values, each stage is timed on its
own with the project's real code, best of `--repeat`:
- engine: `read_scores` of the scored rows, 512 a step (MAX_SCORED_ROWS), then the first output's form;
- worker: `Worker._send_step` of that output, up to the encoded StepTokens frame;
- router: decoding that frame and `RouterCore.step_tokens` with a live request (checks, RequestState, the
  client's Delta, encoded) — the time the router's event loop is busy, every other request's tokens waiting;
- client: decoding the Delta frame and making the StreamChunk (`Logprob` objects).
Works on the protocol before and after the packed form (version 3 and 4), for the before/after figures in
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from types import SimpleNamespace

import torch

from mii_async import protocol as P
from mii_async import async_client
from mii_async.params import SamplingParams
from mii_async.router.admission import Admission
from mii_async.router.balancer import Balancer
from mii_async.router.core import RouterCore, ToClient
from mii_async.router.replicas import Replica, ReplicaSet, WorkerInfo
from mii_async.text.request_state import RequestState
from mii_async.workers.sampling import prompt_logprobs as plmod
from mii_async.workers.engine import EngineOutput
from mii_async.workers.core.sequence import Sequence
from mii_async.workers.worker import Worker

VOCAB = 32_000
ROWS = 512


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _engine_output(prompt: list[int], n: int, gen: torch.Generator) -> tuple[float, EngineOutput]:
    """read_scores over the prompt's rows, ROWS a step, then the EngineOutput of its first token."""
    m = len(prompt) - 1
    own = -torch.rand(m, generator=gen) * 10                                      # [m]
    top_v = -torch.sort(torch.rand(m, max(n, 1), generator=gen) * 10).values[:, :n]   # [m, n], best first
    top_i = torch.randint(0, VOCAB, (m, n), generator=gen)                        # [m, n] int64
    rank = torch.randint(1, VOCAB + 1, (m,), generator=gen)                       # [m] int64
    seq = Sequence(1, prompt, SamplingParams(max_new_tokens=1, prompt_logprobs=n))
    t = time.perf_counter()
    for a in range(0, m, ROWS):
        b = min(m, a + ROWS)
        plmod.read_scores(plmod.PendingScores([(seq, b - a)], [n], (own[a:b], top_v[a:b], top_i[a:b], rank[a:b])))
    first = plmod.packed(seq) if hasattr(plmod, "packed") else seq.prompt_lps       # the engine's _read_ids
    return time.perf_counter() - t, EngineOutput(1, 5, None, None, 0, first)


def _core(tok) -> RouterCore:
    """A router core with one ready replica, whose leader is b"w"."""
    replicas = ReplicaSet(1, "tcp://127.0.0.1:1", None)
    rep = replicas.replicas[0] = Replica(0, 0, 1, False, state="ready")
    rep.workers[0] = WorkerInfo("w", 0, 0, "h", True, {"vocab_size": VOCAB, "max_model_len": 1 << 20,
                                                      "max_request_tokens": 1 << 20})
    core = RouterCore(replicas, Balancer(), Admission(1 << 10, 1 << 40), tok)
    core.state = "ready"
    return core


def measure(positions: int, n: int, repeat: int, tok) -> dict[str, float]:
    gen = torch.Generator().manual_seed(positions + n)
    prompt = [1] + torch.randint(3, VOCAB, (positions,), generator=gen).tolist()
    engine_s = min(_engine_output(prompt, n, gen)[0] for _ in range(repeat))
    _, out = _engine_output(prompt, n, gen)

    sent: list = []
    worker = SimpleNamespace(sock=SimpleNamespace(send=lambda msg: sent.append(P.encode(msg))))
    worker_s, _ = _best(lambda: (sent.clear(), Worker._send_step(worker, [out], True)), repeat)
    frame = sent[0]

    params = SamplingParams(max_new_tokens=2, prompt_logprobs=n)
    core = _core(tok)

    def route():
        live = core.requests.open(b"c", "q", params)
        core.requests.dispatch(live, RequestState(tok, None, prompt, params), core.replicas.replicas[0], 0)
        msg = P.decode(frame)
        msg.req_ids = [live.rid]                  # the engine output's number, as this router numbers it
        core.step_tokens(b"w", msg)
        frames = [P.encode(s.msg) for s in core.sends if isinstance(s, ToClient)]   # what the shell would send
        core.sends.clear()
        core.requests.forget(live)
        assert len(frames) == 1, "the Delta did not go out"
        return frames[0]
    router_s, delta_frame = _best(route, repeat)

    def client():
        chunk = async_client._chunk(P.decode(delta_frame))
        assert len(chunk.prompt_logprobs) == len(prompt)
        return chunk
    client_s, chunk = _best(client, repeat)
    assert chunk.prompt_logprobs[-1].token_id == prompt[-1] and len(chunk.prompt_logprobs[-1].top) == n
    return {"engine_s": engine_s, "worker_s": worker_s, "router_s": router_s, "client_s": client_s,
            "step_frame_bytes": len(frame), "delta_frame_bytes": len(delta_frame)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs=2, type=int, action="append", metavar=("POSITIONS", "N"),
                    help="prompt positions scored and alternatives (default: 100000 1 and 10000 20)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from mii_async.bench.word_tokenizer import save_word_tokenizer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        save_word_tokenizer(d, VOCAB)
        tok = AutoTokenizer.from_pretrained(d)
    print(f"protocol {P.PROTOCOL_VERSION}")
    for positions, n in args.case or [(100_000, 1), (10_000, 20)]:
        m = measure(positions, n, args.repeat, tok)
        print(f"{positions} positions, n={n}: " + ", ".join(
            f"{k} {v * 1e3:.1f} ms" if k.endswith("_s") else f"{k} {v / 2**20:.2f} MiB" for k, v in m.items()))


if __name__ == "__main__":
    main()
