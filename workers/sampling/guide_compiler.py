"""A guide's regex compiled into a token automaton (outlines-core's Index) for one model's vocabulary, in a
child process of its own (workers/sampling/guide_child.py).

A regex's automaton can be far larger than its text: `[^\\n]{0,400}` is 15 characters and took 3.7 s and
880 MiB over a 49k vocabulary. So compiles run in a child that holds the vocabulary, under an address-space
limit (`GUIDE_COMPILE_MEMORY_GIB`) and a deadline (`GUIDE_COMPILE_TIMEOUT_S`). Past either, that request fails
and the child is replaced; the replica never stalls or dies for a guide.
- A failure the same regex would meet again (the deadline, the memory limit, a regex outlines-core refuses) is
  kept, so it fails at once next time; a passing one (the child could not start or read the vocabulary) is not.
- Compiles run one at a time. One that no request waits for any more (all aborted) is skipped, and one
  running for over `ABANDON_AFTER_S` when its last request goes is stopped with its child (a restart costs a
  vocabulary read, so a quick compile is left to finish), so that it holds back no other request's guide.
- Compiled automata are kept per regex, least recently used dropped past `GUIDE_CACHE_BYTES` of their binary form or
  `GUIDE_CACHE_ENTRIES` regexes.
"""
from __future__ import annotations

import itertools
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterable

from mii_async.guided import guide_regex

from .guide_child import HEADER, INDEX, NO_VOCABULARY, READY, REQUEST, write_all

log = logging.getLogger("mii_async.guides")
GUIDE_COMPILE_TIMEOUT_S = 60.0
GUIDE_START_TIMEOUT_S = 120.0      # a child's start: interpreter, tokenizers, reading the vocabulary
GUIDE_COMPILE_MEMORY_GIB = 8.0
GUIDE_CACHE_BYTES = 2 << 30
GUIDE_CACHE_ENTRIES = 256
ABANDON_AFTER_S = 2.0              # a compile nobody waits for any more is stopped past this (see above)
# Numbers every automaton compiled in this process, whichever compiler made it: the masks are cached per
# (automaton, state) in one table (workers/sampling/guides.py).
_AUTOMATON_KEYS = itertools.count(1)


class CompileError(Exception):
    def __init__(self, message: str, lasting: bool) -> None:
        super().__init__(message)
        self.lasting = lasting          # the same regex would fail again: the failure is kept


class _Abandoned(Exception):
    """The compile in progress is wanted by no request any more."""


class GuideCompiler:
    """Regex → Future of (its compiled Index, a number unique to that automaton in this process), for one
    model. Each future carries its `regex`; `release` it when the request that asked no longer waits."""

    def __init__(self, model_path: str | Path, end_ids: Iterable[int], eos: int | None = None,
                 timeout_s: float = GUIDE_COMPILE_TIMEOUT_S, memory_gib: float = GUIDE_COMPILE_MEMORY_GIB) -> None:
        ends = sorted(end_ids)
        if not ends:
            raise ValueError("guided generation needs the model's end id, and this model has none")
        self.model_path, self.end_ids = str(model_path), ends
        self.eos = eos if eos in ends else ends[0]
        self.timeout_s, self.memory_bytes = timeout_s, int(memory_gib * 2**30)
        self._indexes: OrderedDict[str, tuple[Future, int]] = OrderedDict()   # regex → (future, its binary size)
        self._wanted: dict[str, int] = {}     # regex → requests waiting for its compile
        self._bytes = 0
        self._closed = False
        self._lock = threading.Lock()         # the three above
        self._child_lock = threading.Lock()   # one conversation with the child at a time
        self._child: subprocess.Popen | None = None

    # -- the engine's side -------------------------------------------------------------------------------
    def index(self, guide: tuple[str, Any]) -> Future:
        """The Index of a request's guide ((field, value) of its params), compiling it if it is new."""
        regex = guide_regex(*guide)
        with self._lock:
            self._wanted[regex] = self._wanted.get(regex, 0) + 1
            entry = self._indexes.get(regex)
            if entry is not None:
                self._indexes.move_to_end(regex)
                return entry[0]
            fut: Future = Future()
            fut.regex = regex                 # type: ignore[attr-defined]
            if self._closed:
                fut.set_exception(CompileError("the engine is closing", lasting=False))
                return fut
            self._indexes[regex] = (fut, 0)
        threading.Thread(target=self._run, args=(regex, fut), name="mii_async-guide", daemon=True).start()
        return fut

    def release(self, fut: Future) -> None:
        """A request that asked for `fut` no longer waits for it (admitted, or aborted)."""
        with self._lock:
            n = self._wanted.get(fut.regex, 0) - 1       # type: ignore[attr-defined]
            if n > 0:
                self._wanted[fut.regex] = n               # type: ignore[attr-defined]
            else:
                self._wanted.pop(fut.regex, None)         # type: ignore[attr-defined]

    def close(self) -> None:
        """Kills the child; compiles in progress or queued fail, and later ones too."""
        with self._lock:
            self._closed = True
        if self._child_lock.acquire(blocking=False):
            try:
                self._stop_child()
            finally:
                self._child_lock.release()
        elif (proc := self._child) is not None:
            proc.kill()                       # the compile in progress sees it die and reaps it

    # -- the compile thread ------------------------------------------------------------------------------
    def _run(self, regex: str, fut: Future) -> None:
        try:
            index, size = self._compile(regex, fut)
        except CompileError as exc:
            err = exc
        except BaseException as exc:  # noqa: BLE001 - never leave a request waiting on a dead future
            log.exception("compiling a guide failed")
            err = CompileError(f"compiling the guide failed: {exc!r}", lasting=False)
        else:
            fut.set_result((index, next(_AUTOMATON_KEYS)))
            with self._lock:
                if self._indexes.get(regex, (None,))[0] is fut:
                    self._indexes[regex] = (fut, size)
                    self._indexes.move_to_end(regex)
                    self._bytes += size
                self._evict()
            return
        fut.set_exception(err)
        with self._lock:
            if self._indexes.get(regex, (None,))[0] is fut and not err.lasting:
                del self._indexes[regex]
            self._evict()

    def _evict(self) -> None:
        """Drops the least recently used finished entries past the limits (pending ones stay)."""
        over = lambda: self._bytes > GUIDE_CACHE_BYTES or len(self._indexes) > GUIDE_CACHE_ENTRIES  # noqa: E731
        for regex in [r for r, (f, _) in self._indexes.items() if f.done()]:
            if not over():
                return
            self._bytes -= self._indexes.pop(regex)[1]

    def _compile(self, regex: str, fut: Future) -> tuple[Any, int]:
        data = regex.encode("utf-8")
        with self._child_lock:
            with self._lock:
                if self._closed:
                    raise CompileError("the engine is closing", lasting=False)
            if self._unwanted(regex, fut):
                raise CompileError("no request waits for this guide any more", lasting=False)
            proc = self._live_child()
            started = time.monotonic()
            give_up = lambda: time.monotonic() - started > ABANDON_AFTER_S and self._unwanted(regex, fut)  # noqa: E731
            try:
                write_all(proc.stdin.fileno(), REQUEST.pack(len(data)) + data)
                kind, payload = self._frame(proc, started + self.timeout_s, give_up)
            except _Abandoned:
                self._stop_child()
                raise CompileError("no request waits for this guide any more", lasting=False) from None
            except TimeoutError:
                self._stop_child()
                raise CompileError(f"compiling the guide took longer than {self.timeout_s:g} s", lasting=True) from None
            except (EOFError, OSError):
                raise self._died(proc) from None
            except BaseException:
                self._stop_child()
                raise
        if kind != INDEX:
            raise CompileError(payload.decode("utf-8", "replace"), lasting=True)
        from outlines_core import Index

        try:
            return Index.from_binary(payload), len(payload)
        except Exception as exc:  # noqa: BLE001 - outlines-core's own error types
            raise CompileError(f"the guide compiler's answer could not be read: {exc}", lasting=False) from None

    def _died(self, proc: subprocess.Popen) -> CompileError:
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self._stop_child()
        if self._closed:                      # close() killed it
            return CompileError("the engine is closing", lasting=False)
        if code in (-signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV):   # an allocation failed, or the OOM killer
            return CompileError(f"its automaton needs more than the {self.memory_bytes / 2**30:g} GiB a guide may "
                                f"use", lasting=True)
        return CompileError(f"the guide compiler exited ({code}) while compiling it", lasting=False)

    def _unwanted(self, regex: str, fut: Future) -> bool:
        """True when no request waits for `regex`: its entry then leaves the table, under the lock index() takes,
        so a request that comes for it from here on starts a compile of its own instead of taking this one's
        failure."""
        with self._lock:
            if self._wanted.get(regex):
                return False
            if self._indexes.get(regex, (None,))[0] is fut:
                del self._indexes[regex]
            return True

    def _frame(self, proc: subprocess.Popen, deadline: float, give_up=None) -> tuple[int, bytearray]:
        """One frame from the child; `give_up()` is asked, while the answer has not begun, every 0.25 s."""
        kind, size = HEADER.unpack(self._read(proc, HEADER.size, deadline, give_up))
        if size > self.memory_bytes:
            raise EOFError
        return kind, self._read(proc, size, deadline)

    @staticmethod
    def _read(proc: subprocess.Popen, n: int, deadline: float, give_up=None) -> bytearray:
        """n bytes from the child, or TimeoutError at the deadline, or EOFError if it exited. Not copied into
        `bytes`: an automaton may be hundreds of MiB, and Index.from_binary reads the bytearray itself (a copy
        would hold the interpreter's lock, and so every stream of the replica, that much longer)."""
        fd = proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        buf, got = bytearray(n), 0
        view = memoryview(buf)
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not poller.poll(min(left, 0.25) * 1000):
                if got == 0 and give_up is not None and give_up():
                    raise _Abandoned
                continue
            k = os.readv(fd, [view[got:]])
            if not k:
                raise EOFError
            got += k
        return buf

    def _live_child(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._stop_child()
        # A process of its own, started fresh: not forked (the parent may hold CUDA and threads), not
        # multiprocessing's spawn (which runs the caller's main script again, unguarded). It runs from / with
        # this process's import path, so the same mii_async is imported whatever the working directory holds.
        cmd = [sys.executable, "-m", "mii_async.workers.sampling.guide_child", self.model_path, str(self.eos),
               ",".join(map(str, self.end_ids)), str(self.memory_bytes), str(os.getpid())]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, cwd="/", env=env)
        except OSError as exc:
            raise CompileError(f"the guide compiler could not start: {exc}", lasting=False) from None
        self._child = proc
        try:
            kind, payload = self._frame(proc, time.monotonic() + GUIDE_START_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError):
            self._stop_child()
            raise CompileError("the guide compiler did not start", lasting=False) from None
        if kind != READY:
            self._stop_child()
            why = payload.decode("utf-8", "replace") if kind == NO_VOCABULARY else f"answered {kind}"
            raise CompileError(f"the guide compiler did not start: {why}", lasting=False)
        return proc

    def _stop_child(self) -> None:
        proc, self._child = self._child, None
        if proc is not None:
            proc.kill()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            for f in (proc.stdin, proc.stdout):
                f.close()

