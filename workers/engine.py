"""Engine: one replica's model, KV pool, scheduler and sampler, advanced one step at a time.

Not thread-safe: one thread (the local pipeline's engine thread, or a worker's loop) owns it. `check_request`
is pure and may be called from any thread, before a request is handed over.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from mii_async.config import EngineConfig
from mii_async.errors import InvalidParameterError
from mii_async.kernels import get_ops, resolve_backend
from mii_async.model_source import resolve_model
from mii_async.params import SamplingParams
from mii_async.protocol import PromptLogprobs
from mii_async.request_limits import RequestLimits

from .execute import kv_cache
from .core.block_manager import BlockManager
from .execute.cuda_graphs import DecodeGraphs, graph_reserve
from .sampling.guide_compiler import GuideCompiler
from .sampling.guides import GuidedRequests
from .model.loader import TensorReader, WeightReader, load_spec
from .execute.memory_plan import MemoryPlan, plan_kv, profile_step, warn_limits
from .model.registry import model_class
from .model.parallel import TPGroup
from .execute.piecewise_graphs import MAX_TOKENS as PIECEWISE_MAX_TOKENS, PiecewiseGraphs, piecewise_reserve
from .sampling.prompt_logprobs import PendingScores, launch_scores, packed, read_scores
from .execute.runner import Runner
from .sampling.sampler import PendingSample, Sampler, TokenLogprobs
from .core.scheduler import Scheduler
from .core.sequence import Sequence, Status

log = logging.getLogger("mii_async.workers.engine")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineOutput(NamedTuple):
    req_id: int
    token_id: int                       # the token sampled this step
    logprobs: TokenLogprobs | None
    finish_reason: str | None           # "stop" (EOS / stop id) | "length" | None while running
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
        """With `tp`, this process is one rank of a tensor-parallel replica: it holds its shard of the weights
        and of the KV pool; rank 0 runs the loop (`step`), the others `follow()`. `weights` (name → tensor)
        replaces the checkpoint's files: the model directory then needs only its config.json."""
        mc = config.model
        self.config = config
        self.model_path = model_path or resolve_model(mc.model, mc.cache_dir)
        self.spec = spec = load_spec(self.model_path)
        dev = mc.device if mc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(dev)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)   # the kernels launch on the current device of the thread that
                                                 # builds and steps the engine
        dtype_name = mc.dtype if mc.dtype != "auto" else ("float32" if self.device.type == "cpu" else "bfloat16")
        self.dtype = _DTYPES[dtype_name]
        limit = spec.max_position_embeddings
        if spec.sliding_window:
            limit = min(limit, spec.sliding_window)  # dense attention is exact only inside the window
        self.max_model_len = min(mc.max_model_len or limit, limit)
        t0 = time.perf_counter()
        self.tp = tp
        try:
            self.kernels = resolve_backend(mc.kernels, self.device.type)
        except ValueError as exc:
            raise InvalidParameterError("kernels", str(exc)) from None
        reader = TensorReader(weights) if weights is not None else WeightReader(self.model_path)
        self.model = model_class(spec).load(spec, reader, self.dtype, self.device,
                                     self.max_model_len, get_ops(self.kernels), tp)
        kv_spec = dataclasses.replace(spec, num_kv_heads=self.model.num_kv_heads)   # this rank's KV heads
        self.load_seconds = time.perf_counter() - t0
        cc = config.cache
        sched = config.scheduler.resolved(self.device.type)
        self.config = config = dataclasses.replace(config, scheduler=sched)
        self.sampler = Sampler(spec.vocab_size, spec.eos_token_ids, self.device)
        graphs = self.device.type == "cuda" and mc.cuda_graphs and tp is None   # TP graphs: not yet
        max_graph_batch = min(sched.max_num_seqs, 512)
        piecewise = graphs and mc.piecewise_graphs
        piecewise_tokens = min(sched.max_mixed_batch_tokens or sched.max_batch_tokens, PIECEWISE_MAX_TOKENS)
        self.memory_plan = None
        per_block = kv_cache.bytes_per_block(kv_spec, cc.block_size, self.dtype)
        if cc.num_blocks:
            num_blocks = cc.num_blocks
        elif self.device.type != "cuda" or cc.kv_cache_memory is not None:
            num_blocks = int((cc.kv_cache_memory or cc.CPU_KV_GIB) * 2**30 // per_block)
        else:
            reserve = ((graph_reserve(max_graph_batch, spec.vocab_size) if graphs else 0)
                       + (piecewise_reserve(self.model, piecewise_tokens) if piecewise else 0))
            self.memory_plan = self._plan_memory(kv_spec, per_block, sched, reserve)
            num_blocks = self.memory_plan.num_blocks
        num_blocks = max(1, num_blocks) if tp is None else tp.min_int(max(1, num_blocks))   # same ids on all ranks
        self.num_blocks = num_blocks
        if tp is None or tp.rank == 0:
            warn_limits(mc.max_model_len, limit, self.max_model_len, num_blocks * cc.block_size)
        # With graphs, one more block than the block manager knows: the scratch block of padded rows.
        self.kv = kv_cache.allocate(kv_spec, num_blocks + int(graphs), cc.block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.block_manager)
        self.runner = Runner(self.model, self.kv, cc.block_size, self.device)
        if graphs:
            self.runner.graphs = DecodeGraphs(self.model, self.kv, cc.block_size, self.device, max_graph_batch,
                                              self.max_model_len, scratch_block=num_blocks)
            self.runner.graphs.capture()
        if piecewise:
            self.runner.piecewise = PiecewiseGraphs(self.model, self.kv, self.device, piecewise_tokens,
                                                    num_blocks * cc.block_size, max_rows=sched.max_num_seqs)
            self.runner.piecewise.capture()
        if self.memory_plan is not None:
            measured = sum(g.memory for g in (self.runner.graphs, self.runner.piecewise) if g is not None)
            if measured > self.memory_plan.graph_reserve:
                log.warning("the CUDA graphs took %.2f GiB, more than the %.2f GiB the memory plan set aside",
                            measured / 2**30, self.memory_plan.graph_reserve / 2**30)
            log.info("%s; graphs measured %.2f GiB; token budget %d per step (%d while requests decode%s), %d "
                     "sequences at most", self.memory_plan.describe(), measured / 2**30, sched.max_batch_tokens,
                     sched.max_mixed_batch_tokens,
                     f"; steps cut to multiples of {m}" if (m := sched.step_token_multiple or 1) > 1 else "",
                     sched.max_num_seqs)
        self.seqs: dict[int, Sequence] = {}
        self.num_steps = 0
        self.async_scheduling = (sched.async_scheduling if sched.async_scheduling is not None
                                 else self.device.type == "cuda")
        if tp is not None:
            self.async_scheduling = False   # the other ranks would need the device ids too: not yet
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
        assert req_id not in self.seqs, f"request id {req_id} is already live"
        self.check_request(prompt_ids, params)
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
                reason: str | None = "stop"
            elif len(seq.prompt_ids) + n >= seq.max_tokens:
                reason = "length"
            else:
                reason = None
            if seq.guide is not None and reason is None and (tok in eos or not seq.guide.advance(tok)):
                reason = "stop"              # a guide's mask allows an end id only once the output is complete
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

    def _plan_memory(self, kv_spec, per_block: int, sched, reserve: int) -> MemoryPlan:
        cc = self.config.cache
        block_shape = (cc.block_size, kv_spec.num_kv_heads, kv_spec.head_dim)
        return plan_kv(lambda: profile_step(self.model, self.sampler, kv_spec.num_layers, block_shape, self.dtype,
                                            self.device, sched.max_batch_tokens, sched.max_num_seqs,
                                            self.max_model_len, cc.block_size, Runner),
                       self.device, cc.gpu_memory_utilization, per_block, cc.block_size, sched.max_batch_tokens,
                       reserve)

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
