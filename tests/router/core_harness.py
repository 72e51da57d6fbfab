"""A RouterCore as its shells drive it, for the router's unit tests: ready replicas without processes, prompts
encoded by the real PromptEncoder over a word tokenizer, what the core sends collected."""
from __future__ import annotations

from mii_async import protocol as P
from mii_async.router.admission import Admission
from mii_async.router.balancer import Balancer
from mii_async.router.core import Encode, RouterCore, ToClient
from mii_async.router.replicas import Replica, ReplicaSet, WorkerInfo
from mii_async.text.prompts import PromptEncoder

VOCAB = 64          # the word tokenizer's ids: <unk> <s> </s>, then "w3" … "w63"
CONTEXT = 1 << 16   # every replica's max_model_len and max_request_tokens


class Harness:
    """A RouterCore with `n` ready replicas (leaders b"w0", b"w1", …), fed events as the shells feed them; the
    prompts are encoded by the real PromptEncoder."""

    def __init__(self, tokenizer, n: int = 1, *, max_queued_requests: int = 1024, max_queued_tokens: int = 1 << 21,
                 state: str = "ready", context: int = CONTEXT) -> None:
        self.context = context            # every replica's max_model_len and max_request_tokens
        self.replicas = ReplicaSet(1, "tcp://127.0.0.1:1", None)
        for i in range(n):
            self.add_replica(i)
        self.core = RouterCore(self.replicas, Balancer(16), Admission(max_queued_requests, max_queued_tokens),
                               tokenizer)
        self.core.state = state
        self.encoder = PromptEncoder(tokenizer)
        self.encodes = 0                  # prompts handed to the encoder, as the shell hands them to its thread

    def add_replica(self, index: int) -> Replica:
        rep = Replica(index, 0, 1, local=False, state="ready")
        rep.workers[0] = WorkerInfo(f"w{index}", 0, 100 + index, "host", True,
                                    {"vocab_size": VOCAB, "max_model_len": self.context,
                                     "max_request_tokens": self.context})
        self.replicas.replicas[index] = rep
        return rep

    def submit(self, creq: str, prompt: str = "w5 w6 w7", peer: bytes = b"c", encode: bool = True,
               **params) -> Encode | None:
        """A client's Generate; encoded at once unless `encode` is False (the Encode job is returned)."""
        job = self.core.client_message(peer, P.Generate(req_id=creq, prompt=prompt, params=params))
        if job is not None and encode:
            self.encode(job)
        return job

    def encode(self, job: Encode) -> None:
        """As the shell encodes: a prompt the encoder refuses refuses the request."""
        self.encodes += 1
        try:
            text, ids = self.encoder.encode(job.prompt, job.tools, job.parallel_tool_calls)
        except Exception as exc:  # noqa: BLE001 - as server.py's _encode
            self.core.encode_failed(job.rid, exc)
        else:
            self.core.encoded(job.rid, text, ids, fit_context=job.fit_context)

    def step(self, leader: bytes, tokens: dict[int, int], finish: dict[int, str] | None = None) -> None:
        """A StepTokens from `leader`: router request number → sampled token."""
        rids = list(tokens)
        self.core.step_tokens(leader, P.StepTokens(req_ids=rids, token_ids=[tokens[r] for r in rids],
                                                   finish_reasons=[(finish or {}).get(r) for r in rids],
                                                   cached_tokens=[0] * len(rids)))

    def sends(self) -> list:
        out = list(self.core.sends)
        self.core.sends.clear()
        return out

    def rid(self, creq: str, peer: bytes = b"c") -> int:
        live = self.core.requests.find(peer, creq)
        assert live is not None, f"{creq} is not live"
        return live.rid


def refusal(sends: list) -> P.ErrorReply:
    [s] = sends
    assert isinstance(s, ToClient) and isinstance(s.msg, P.ErrorReply), s
    return s.msg

