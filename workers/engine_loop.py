"""EngineLoop: one engine's serving loop — typed commands in, outputs out — for every driver.

The loop drains every command that arrived, then steps while the engine has work; idle, it waits for the next
command. It touches no socket and no queue: a driver hands `run` its `receive` (the worker process: ZeroMQ
messages decoded into commands; the local pipeline: a thread's queue) and the loop's constructor its `out`
(StepTokens and RequestFailed on the wire; each request's sink). Both are called on the loop's thread, which
owns the engine. One bad request is answered with a RequestEnded("error") and never stops the loop; a step
that fails ends every live request with an error, and the loop goes on serving.

Per request, the outputs are its tokens (in Tokens) until one carries a finish_reason, or until a
RequestEnded ("abort" after an Abort or a Stop, "error"): either way it is then gone from the engine. Every
output goes out as soon as it exists: with async scheduling a step's tokens are handed to `out` during the
next step's launch.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mii_async.outputs import FinishReason
from mii_async.params import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine, EngineOutput

log = logging.getLogger("mii_async.workers.engine_loop")


# -- commands (driver → loop) --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a request. The driver has checked it (the router against its replicas' limits, the local pipeline
    against its engine's); the engine takes it as it is."""
    req_id: int                         # the driver's id, unique among live requests
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Abort:
    """End a request now and free its KV blocks; one that is not live (ended already) is ignored."""
    req_id: int


@dataclass(frozen=True, slots=True)
class QueryStats:
    """Report the engine's counters (a Stats output), after forgetting the free blocks' prefixes if asked."""
    tag: object                         # the driver's, handed back in the Stats (a wire token, a Future)
    reset_prefix_cache: bool = False


@dataclass(frozen=True, slots=True)
class Stop:
    """Read the step in flight, end every live request with "abort", and return from `run`."""
    why: str | None = None              # the message of those RequestEnded


Command = AddRequest | Abort | QueryStats | Stop


# -- outputs (loop → driver) ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Tokens:
    """The tokens of one step, as soon as they are read (never empty)."""
    outputs: list[EngineOutput]         # one per sampled request, in row order; a finish_reason ends it


@dataclass(frozen=True, slots=True)
class RequestEnded:
    """A request ended without a token: it holds nothing in the engine any more."""
    req_id: int
    reason: FinishReason                # ABORT (Abort, Stop) | ERROR (refused, a failed step, a guide)
    message: str | None = None
    param: str | None = None            # the caller's value at fault, when it can never work (a guide)


@dataclass(frozen=True, slots=True)
class Stats:
    """The engine's counters (Engine.stats): the answer to a QueryStats, or, with tag None, a refresh every
    `stats_refresh_s` of stepping for a driver that publishes them (the worker's heartbeats)."""
    tag: object
    stats: dict[str, int]
    forgotten: int | None = None        # prefix blocks forgotten, when the query asked to reset the cache


Output = Tokens | RequestEnded | Stats
Receive = Callable[[float | None], Command | None]   # (timeout s; None: until one comes) → a command, or None


class EngineLoop:
    """Not thread-safe: `run`, `handle` and `step` are called on the thread that owns the engine; `out` may
    `handle` an Abort of a request whose consumer is gone, while its tokens are handed over."""

    def __init__(self, engine: Engine, out: Callable[[Output], None], stats_refresh_s: float | None = None) -> None:
        self.engine = engine
        self.out = out
        self.stats_refresh_s = stats_refresh_s
        self.stopped = False
        self._stats_at = time.monotonic()

    def run(self, receive: Receive) -> None:
        """Serves until a Stop. `receive(timeout)` is asked with 0 while the engine has work (only what has
        arrived), else with None (until a command comes); it may return None early (a driver that must see a
        stop signal of its own while idle waits in slices, and answers Stop once it is set)."""
        eng = self.engine
        while not self.stopped:
            cmd = receive(0.0 if eng.has_work() else None)
            while cmd is not None:
                self.handle(cmd)
                if self.stopped:
                    return
                cmd = receive(0.0)
            if eng.has_work():
                self.step()

    def handle(self, cmd: Command) -> None:
        """Carries out one command; its answer, if any, goes to `out` before this returns."""
        eng = self.engine
        if isinstance(cmd, AddRequest):
            try:
                if cmd.req_id in eng.seqs:
                    raise ValueError(f"request {cmd.req_id} is already live")
                eng.add_request(cmd.req_id, cmd.prompt_ids, cmd.params)
            except Exception as exc:  # noqa: BLE001 - one bad request is answered, never stops the loop
                self.out(RequestEnded(cmd.req_id, FinishReason.ERROR, f"{type(exc).__name__}: {exc}"))
        elif isinstance(cmd, Abort):
            if eng.abort(cmd.req_id):
                self.out(RequestEnded(cmd.req_id, FinishReason.ABORT))
        elif isinstance(cmd, QueryStats):
            forgotten = eng.reset_prefix_cache() if cmd.reset_prefix_cache else None
            self.out(Stats(cmd.tag, eng.stats(), forgotten))
        elif isinstance(cmd, Stop):
            self._stop(cmd.why)
        else:
            raise AssertionError(f"not a command: {cmd!r}")

    def step(self) -> None:
        """One engine step; its tokens (or, with async scheduling, the step before's) go out as soon as they
        are read, which may be during this step's launch. A failed step ends every live request with an
        error, except on one rank of a tensor-parallel group, where it is raised: the other ranks may be
        inside the step's collectives, so the group is out of step for good and its process must exit."""
        eng = self.engine
        try:
            self._tokens(eng.step(emit=self._tokens))
        except Exception as exc:  # noqa: BLE001 - fail the live requests, keep serving
            log.exception("engine step failed")
            if eng.tp is not None:
                raise
            for req_id in list(eng.seqs):
                eng.abort(req_id)
                self.out(RequestEnded(req_id, FinishReason.ERROR, f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            for req_id, why, param in eng.take_failed():     # e.g. a guide this model's vocabulary cannot follow
                self.out(RequestEnded(req_id, FinishReason.ERROR, why, param))
        if self.stats_refresh_s is not None and (now := time.monotonic()) - self._stats_at > self.stats_refresh_s:
            self._stats_at = now
            self.out(Stats(None, eng.stats()))

    def _tokens(self, outputs: list[EngineOutput]) -> None:
        if outputs:
            self.out(Tokens(outputs))

    def _stop(self, why: str | None) -> None:
        """No token the device computed is lost (the step in flight is read and handed out), and no request
        is left holding blocks."""
        eng = self.engine
        self.stopped = True
        try:
            self._tokens(eng.flush())
        except Exception:  # noqa: BLE001 - stopping anyway: its requests end below
            log.exception("reading the step in flight failed")
        for req_id in list(eng.seqs):
            eng.abort(req_id)
            self.out(RequestEnded(req_id, FinishReason.ABORT, why))
