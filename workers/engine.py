"""Engine: one replica's model, KV pool, scheduler and sampler (built by engine_build.py), advanced one step
at a time.

Not thread-safe: one thread, the one that runs its EngineLoop (engine_loop.py: the local pipeline's engine
thread, or a worker process's main thread), owns it. It takes the requests it is handed as they are: the
router checked them against the limits its replicas report (`limits`), and the local pipeline, which has no
router, with `check_request`, which is pure and may be called from any thread.
"""
from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from mii_async.config import EngineConfig
from mii_async.outputs import FinishReason, Logprob
from mii_async.params import SamplingParams
from mii_async.protocol import PromptLogprobs
from mii_async.request_limits import RequestLimits

from .core.sequence import Sequence, Status
from .engine_build import build
from .model.parallel import TPGroup
from .sampling.guide_compiler import GuideCompiler
from .sampling.guides import GuidedRequests
from .sampling.prompt_logprobs import PendingScores, launch_scores, packed, read_scores
from .sampling.sampler import PendingSample

log = logging.getLogger("mii_async.workers.engine")
_STOP, _LENGTH = FinishReason.STOP, FinishReason.LENGTH   # module constants: read per sampled token


class EngineOutput(NamedTuple):
    req_id: int
    token_id: int                       # the token sampled this step
    logprobs: Logprob | None            # when its request asked (no texts: the engine has no tokenizer)
    finish_reason: FinishReason | None  # STOP (EOS / stop id) | LENGTH | None while running
    cached_tokens: int                  # prompt tokens this request took from the prefix cache
    # params.prompt_logprobs: on a request's first token only, packed as they travel (positions 1 … L−1)
    prompt_logprobs: PromptLogprobs | None = None


class _InFlight(NamedTuple):
    """A step launched and not read yet (async scheduling)."""
    seqs: list[Sequence]                # the sampled sequences, in row order
    slots: list[int]                    # where each one's placeholder sits in its output_ids
    sample: PendingSample
    history_free: bool                  # no row's sampling reads the output so far
    scores: PendingScores | None = None # the step's prompt logprobs, if it scored prompt rows


class Engine:
    def __init__(self, config: EngineConfig, model_path: Path | None = None, tp: TPGroup | None = None,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        """Builds the engine's parts (`engine_build.build`: the model, the KV pool, the runner and its graphs,
        …). With `tp`, this process is one rank of a tensor-parallel replica: rank 0 runs the loop (`step`),
        the others `follow()`. `weights` (name → tensor) replaces the checkpoint's files: the model directory
        then needs only its config.json."""
        parts = build(config, model_path, tp, weights)
        self.config = parts.config
        self.model_path, self.spec, self.model = parts.model_path, parts.spec, parts.model
        self.device, self.dtype, self.kernels = parts.device, parts.dtype, parts.kernels
        self.max_model_len, self.tp, self.load_seconds = parts.max_model_len, parts.tp, parts.load_seconds
        self.memory_plan, self.num_blocks, self.kv = parts.memory_plan, parts.num_blocks, parts.kv
        self.block_manager, self.scheduler = parts.block_manager, parts.scheduler
        self.runner, self.sampler = parts.runner, parts.sampler
        self.async_scheduling = parts.async_scheduling
        self.seqs: dict[int, Sequence] = {}
        self.num_steps = 0
        self._inflight: _InFlight | None = None
        self.guided: GuidedRequests | None = None      # made at the first guided request
        self._arrivals = itertools.count()             # Sequence.arrival: the waiting queue's order
        self.failed: list[tuple[int, str, str | None]] = []   # (req_id, why, param): `take_failed`
        # What exists now (the model, its modules, the tokenizer, the process's imports) lives as long as the
        # engine: moved out of the collector's generations, so that a full collection during serving does not
        # walk it (one took 284 ms, a whole step, in the H200 mixed load).
        gc.collect()
        gc.freeze()

    # -- requests ------------------------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request may hold: the context and the whole pool bound it."""
        return min(self.max_model_len, self.num_blocks * self.config.cache.block_size)

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.spec.vocab_size, self.max_model_len, self.max_request_tokens)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises an InvalidParameterError naming what makes the request impossible."""
        self.limits.check(prompt_ids, params)

    def add_request(self, req_id: int, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queues a request its driver checked (`check_request`, or the router against `limits`)."""
        assert req_id not in self.seqs, f"request id {req_id} is already live"
        # what the scheduler needs to finish it: it fits the pool whole (else it could wait forever)
        assert 0 < len(prompt_ids) and len(prompt_ids) + params.max_new_tokens <= self.max_request_tokens, \
            f"request {req_id} of {len(prompt_ids)} + {params.max_new_tokens} tokens was not checked against " \
            f"the limits ({self.max_request_tokens} tokens)"
        seq = Sequence(req_id, list(prompt_ids), params, arrival=next(self._arrivals))
        seq.max_tokens = min(seq.max_tokens, self.max_model_len)
        if params.guide is not None:
            self.guided_compiler()
            self.guided.hold(seq)                      # type: ignore[union-attr] - scheduled once its automaton
        else:                                          # is compiled (`_admit_guided`)
            self.scheduler.add(seq)
        self.seqs[req_id] = seq

    def guided_compiler(self) -> GuideCompiler:
        """The compiler of this engine's guides, made at first use (a guide may be compiled ahead with it)."""
        if self.guided is None:
            self.guided = GuidedRequests(GuideCompiler(self.model_path, self.spec.eos_token_ids))
        return self.guided.compiler

    def close(self) -> None:
        """Stops what the engine started besides its tensors (the guide compiler's process). Idempotent."""
        if self.guided is not None:
            self.guided.close()

    def take_failed(self) -> list[tuple[int, str, str | None]]:
        """(req_id, why, param) of the requests ended with an error since the last call (a guide that cannot
        be compiled); `param` names a value of the caller's that can never work, which refuses the request."""
        failed, self.failed = self.failed, []
        return failed

    def _admit_guided(self) -> None:
        admitted, failed = self.guided.ready()       # type: ignore[union-attr]
        for seq in admitted:
            self.scheduler.add(seq)
        for seq, why, param in failed:
            del self.seqs[seq.req_id]
            self.failed.append((seq.req_id, why, param))
        if not admitted and not self.scheduler.has_work() and self._inflight is None:
            self.guided.wait(0.01)                     # type: ignore[union-attr] - nothing else to do: no spin

    def abort(self, req_id: int) -> bool:
        """Ends a request now and frees its blocks; False if it was not live."""
        seq = self.seqs.pop(req_id, None)
        if seq is None:
            return False
        if self.guided is not None and self.guided.drop(req_id):
            return True                                # still compiling: it holds nothing
        self.scheduler.remove(seq)
        self.sampler.release(req_id)
        return True

    def reset_prefix_cache(self) -> int:
        """Forgets the prefixes of the blocks no request holds; returns how many blocks were forgotten."""
        return self.block_manager.reset_prefix_cache()

    def has_work(self) -> bool:
        return (self._inflight is not None or self.scheduler.has_work()
                or (self.guided is not None and bool(self.guided.pending)))

    # -- the step ------------------------------------------------------------------------------------
    def step(self, emit: Callable[[list[EngineOutput]], None] | None = None) -> list[EngineOutput]:
        """Advances by one step; returns the tokens sampled. With async scheduling these are the previous
        step's: this one is launched first, so that the device never waits for the host's bookkeeping.

        `emit`: with async scheduling, the previous step's tokens are handed to it as soon as the device has
        them, while this step is still being launched (the launch of an eager step of a few hundred kernels
        blocks the host once the device's launch queue is full, until the device has run most of it; reading
        only after the launch would hold finished tokens back by up to a step, and deliver two steps' tokens
        at once). Tokens passed to `emit` are not returned."""
        if self.guided is not None and self.guided.pending:
            self._admit_guided()
        if self.async_scheduling:
            return self._step_async(emit)
        launched = self._launch(None)
        return self._read(launched) if launched is not None else []

    def _step_async(self, emit: Callable[[list[EngineOutput]], None] | None) -> list[EngineOutput]:
        """Schedules and launches step N+1 while step N runs, then reads N's ids. N's sampled sequences hold
        placeholders that N+1's inputs take from the device; one whose token turns out to end it wasted a row
        of N+1, which is dropped. Steps wait for N first when a row of N+1 would sample from a history that
        holds a placeholder (penalties). With `emit`, N is read between two layers of N+1's launch once its
        ids are on the host; the sequences it ends are released after the launch."""
        prev, self._inflight = self._inflight, None
        outputs: list[EngineOutput] = []
        if prev is not None and not prev.history_free:
            outputs, prev = self._read(prev), None
        early: list[list[Sequence]] = []             # the sequences N ended, once read early
        handed: list[bool] = []                      # and [True] once `emit` returned with N's tokens

        def poll() -> None:
            if not early and prev is not None and prev.sample.is_ready():
                out, finished = self._read_ids(prev)
                early.append(finished)
                emit(out)                           # type: ignore[misc]
                handed.append(True)

        try:
            self._inflight = self._launch(prev, poll if emit is not None and prev is not None else None)
        finally:
            # Also when the launch fails: a request whose last token went out is not left running. One whose
            # last token `emit` raised on stays live, for the caller's failure handling to end it (a worker
            # tells the router). (`emit` may have aborted some of them: a consumer that has gone away.)
            if handed and (done := [s for s in early[0] if s.status is not Status.FINISHED]):
                self._finish(done)
        if not early and prev is not None:
            outputs = self._read(prev)
        return outputs

    def _launch(self, prev: _InFlight | None, between_layers: Callable[[], None] | None = None) -> _InFlight | None:
        """Schedules a step and enqueues its forward pass and sampling; each sampled sequence gets a placeholder
        id until `_read`. `prev`: the step still in flight, whose ids the placeholders in this plan stand for.
        `between_layers`, called between the layers of an eager forward, may read `prev` (and `emit` may abort
        requests): the forward reads only the plan's own copies. A sequence that ends then still has its row
        in this step, which its read drops. The plan is committed once the whole forward is enqueued, so a
        forward that raises midway leaves no block it did not write findable in the prefix cache."""
        plan = self.scheduler.schedule()
        if not plan:
            return None
        if self.tp is not None:
            self.tp.send_plan(plan)
        logits = self.runner.execute(plan, prev.sample.token_ids if prev is not None else None, between_layers)
        scores = None
        if plan.num_scored:                                # the rows after the sampled ones
            scores = launch_scores(plan, self.scheduler.planned(), logits[-plan.num_scored:])
            logits = logits[:-plan.num_scored]
        sampled = self.scheduler.commit_step()
        sample = self.sampler.launch(logits, sampled)      # (before the placeholders: penalties read the history)
        slots = []
        for i, seq in enumerate(sampled):
            seq.output_ids.append(-1 - i)
            seq.num_pending += 1
            slots.append(len(seq.output_ids) - 1)
        self.num_steps += 1
        return _InFlight(sampled, slots, sample, all(s.history_free for s in sampled), scores)

    def flush(self) -> list[EngineOutput]:
        """Reads the step in flight, if any (async scheduling): afterwards no output id is a placeholder."""
        prev, self._inflight = self._inflight, None
        return self._read(prev) if prev is not None else []

    def _read(self, step: _InFlight) -> list[EngineOutput]:
        """Reads a launched step's ids into its sequences' placeholders and ends those that are done."""
        outputs, finished = self._read_ids(step)
        if finished:
            self._finish(finished)
        return outputs

    def _read_ids(self, step: _InFlight) -> tuple[list[EngineOutput], list[Sequence]]:
        """`_read` but for ending the finished sequences, which it returns: "stop" (EOS / a stop id, once
        min_new_tokens exist) before "length". Runs once per sampled sequence per step, so the checks are
        inlined."""
        result = self.sampler.resolve(step.sample)
        if step.scores is not None:
            read_scores(step.scores)         # (its copies were queued before the sample's event)
        outputs, finished = [], []
        eos, register = self.spec.eos_token_ids, self.block_manager.register_full_blocks
        async_ = self.async_scheduling
        for seq, at, tok, lp in zip(step.seqs, step.slots, result.token_ids, result.logprobs):
            if seq.status is Status.FINISHED:
                continue                     # aborted, or ended by the step before: its row is dropped
            out = seq.output_ids
            out[at] = tok
            seq.num_pending -= 1
            p, n = seq.params, at + 1
            if n >= p.min_new_tokens and (tok in p.stop_token_ids or (not p.ignore_eos and tok in eos)):
                reason: FinishReason | None = _STOP
            elif len(seq.prompt_ids) + n >= seq.max_tokens:
                reason = _LENGTH
            else:
                reason = None
            if seq.guide is not None and reason is None and (tok in eos or not seq.guide.advance(tok)):
                reason = _STOP               # a guide's mask allows an end id only once the output is complete
                if tok not in eos:
                    log.warning("request %d: token %d is outside its guide; ended", seq.req_id, tok)
            if reason is not None:
                del out[n:]                  # the next step's placeholder, if it was scheduled
                seq.num_pending = 0
                finished.append(seq)
            if async_ and seq.num_pending == 0 and seq.status is Status.RUNNING:
                register(seq)                # blocks whose hashing waited on this token (synchronous steps
                                             # commit with no placeholder, so they hashed them already)
            outputs.append(EngineOutput(seq.req_id, tok, lp, reason, seq.num_cached_prompt_tokens,
                                        packed(seq) if at == 0 and seq.prompt_lps is not None else None))
        return outputs, finished

    def _finish(self, seqs: list[Sequence]) -> None:
        """`abort` of each finished sequence, in sampling order, with one pass over the running list."""
        for seq in seqs:
            del self.seqs[seq.req_id]
            self.sampler.release(seq.req_id)
        self.scheduler.remove_many(seqs)

    def follow(self) -> None:
        """Ranks > 0: run every plan rank 0 sends, until it says stop."""
        assert self.tp is not None and self.tp.rank > 0, "follow() is for the other ranks of a TP group"
        while (plan := self.tp.recv_plan()) is not None:
            self.runner.execute(plan)

    def stop_followers(self) -> None:
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send_plan(None)

    def stats(self) -> dict[str, int]:
        cs = self.block_manager.stats()
        return {
            "num_blocks": cs.num_blocks, "free_blocks": cs.num_free, "used_blocks": cs.num_blocks - cs.num_free,
            "cached_blocks": cs.num_cached, "prefix_hit_tokens": cs.hit_tokens, "prefix_query_tokens": cs.query_tokens,
            "running": sum(1 for s in self.seqs.values() if s.status is Status.RUNNING),
            "waiting": sum(1 for s in self.seqs.values() if s.status is Status.WAITING),
            "preemptions": self.scheduler.num_preemptions, "steps": self.num_steps,
            **self._tp_stats(),
        }

    def _tp_stats(self) -> dict[str, int]:
        tp = self.tp
        if tp is None or tp.rank != 0:
            return {}
        return {"tp_plan_broadcast_us_per_step": int(1e6 * tp.plan_seconds / max(1, tp.plans_sent))}
