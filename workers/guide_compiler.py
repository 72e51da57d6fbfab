"""A guide's regex compiled into a token automaton (outlines-core's Index) for one model's vocabulary, in a
child process of its own.

A regex's automaton can be far larger than its text: `[^\\n]{0,400}` is 15 characters and took 3.7 s and
880 MiB over a 49k vocabulary. So compiles run in a child process that holds the vocabulary, under an address
space limit (`GUIDE_COMPILE_MEMORY_GIB`) and a deadline (`GUIDE_COMPILE_TIMEOUT_S`): past either, that request
fails, the child is killed if need be, and the next compile starts a fresh one. The replica never stalls or
dies for a guide. Compiled automata come back pickled and are kept per regex, least recently used dropped past
`GUIDE_CACHE_BYTES`. The child imports neither torch nor transformers (the vocabulary comes from
tokenizer.json through `tokenizers`), so it starts in a fraction of a second; it exits when its pipe closes,
and within a second of its replica's death, even in the middle of a compile.
"""
from __future__ import annotations

import itertools
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterable

from mii_async.guided import guide_regex

log = logging.getLogger("mii_async.guides")
GUIDE_COMPILE_TIMEOUT_S = 60.0
GUIDE_COMPILE_MEMORY_GIB = 8.0
GUIDE_CACHE_BYTES = 2 << 30
# Numbers every automaton compiled in this process, whichever compiler made it: the masks are cached per
# (automaton, state) in one table (workers/guides.py). (next() on a count is atomic under the GIL.)
_AUTOMATON_KEYS = itertools.count(1)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes (a ByteLevel tokenizer's vocabulary is written in them) → byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer: Any) -> dict[bytes, list[int]]:
    """Each token's bytes → its ids, for a `tokenizers.Tokenizer` (or a transformers fast tokenizer). Special
    tokens are left out: a guide never allows them. ByteLevel vocabularies (GPT-2, Llama 3, Qwen2, SmolLM) map
    through GPT-2's byte alphabet; SentencePiece ones (Llama 2, Mistral) write a space as ▁ and raw bytes as
    <0xHH>; added tokens that are not special stand for their text."""
    tk = getattr(tokenizer, "backend_tokenizer", tokenizer)
    added = tk.get_added_tokens_decoder()
    byte_level = "ByteLevel" in repr(tk.decoder)
    dec = _byte_decoder() if byte_level else {}
    out: dict[bytes, list[int]] = {}
    for tok, i in tk.get_vocab(with_added_tokens=False).items():
        if i in added:
            continue
        if byte_level and all(c in dec for c in tok):
            b = bytes(dec[c] for c in tok)
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            b = bytes([int(tok[3:5], 16)])
        else:
            b = tok.replace("▁", " ").encode("utf-8")
        if b:
            out.setdefault(b, []).append(i)
    for i, t in added.items():
        if not t.special and t.content:
            out.setdefault(t.content.encode("utf-8"), []).append(i)
    return out


def _tokenizer(model_path: str) -> Any:
    from tokenizers import Tokenizer

    path = Path(model_path) / "tokenizer.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    from transformers import AutoTokenizer          # a slow tokenizer's files: transformers converts them

    return AutoTokenizer.from_pretrained(model_path).backend_tokenizer


def _read_exact(f: Any, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError
    return data


def child_main(argv: list[str]) -> int:
    """The compiling child (`python -m mii_async.workers.guide_compiler MODEL EOS END_IDS MEMORY_BYTES`):
    builds the vocabulary once, then answers each regex read from stdin (a 4-byte length, then UTF-8) with a
    flag byte (1: a pickled Index follows, 0: why it failed) and an 8-byte length, until stdin closes."""
    import resource
    import struct

    from outlines_core import Index, Vocabulary

    model_path, eos, end_ids, memory_bytes = argv[0], int(argv[1]), {int(i) for i in argv[2].split(",")}, int(argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    parent = os.getppid()

    def orphaned() -> None:           # the replica died (even mid-compile: outlines-core releases the GIL)
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        vocab = {b: [i for i in ids if i not in end_ids] for b, ids in token_bytes(_tokenizer(model_path)).items()}
        vocabulary, why = Vocabulary(eos, {b: ids for b, ids in vocab.items() if ids}), ""
    except Exception as exc:  # noqa: BLE001 - every compile then fails with this reason
        vocabulary, why = None, f"the vocabulary could not be read: {exc}"
    while True:
        try:
            regex = _read_exact(inp, struct.unpack("<I", _read_exact(inp, 4))[0]).decode("utf-8")
        except EOFError:
            return 0
        ok, payload = False, why.encode()
        if vocabulary is not None:
            try:
                ok, payload = True, pickle.dumps(Index(regex, vocabulary))
            except MemoryError:
                payload = f"its automaton needs more than {memory_bytes / 2**30:g} GiB".encode()
            except Exception as exc:  # noqa: BLE001 - outlines-core's own error types
                payload = f"the guide cannot be compiled for this model's vocabulary: {exc}".encode()
        out.write(struct.pack("<BQ", ok, len(payload)) + payload)
        out.flush()


class CompileError(Exception):
    def __init__(self, message: str, lasting: bool) -> None:
        super().__init__(message)
        self.lasting = lasting          # the same regex would fail again: the failure is cached


class GuideCompiler:
    """Regex → Future of (its compiled Index, a number unique to that automaton), for one model; compiles run
    one at a time in the child."""

    def __init__(self, model_path: str | Path, end_ids: Iterable[int], eos: int | None = None,
                 timeout_s: float = GUIDE_COMPILE_TIMEOUT_S, memory_gib: float = GUIDE_COMPILE_MEMORY_GIB) -> None:
        ends = sorted(end_ids)
        if not ends:
            raise ValueError("guided generation needs the model's end id, and this model has none")
        self.model_path, self.end_ids = str(model_path), ends
        self.eos = eos if eos in ends else ends[0]
        self.timeout_s, self.memory_bytes = timeout_s, int(memory_gib * 2**30)
        self._indexes: OrderedDict[str, tuple[Future, int]] = OrderedDict()   # regex → (future, its bytes)
        self._bytes = 0
        self._lock = threading.Lock()         # the cache
        self._child_lock = threading.Lock()   # one conversation with the child at a time
        self._child: subprocess.Popen | None = None

    def index(self, guide: tuple[str, Any]) -> Future:
        """The Index of a request's guide ((field, value) of its params), compiling it if it is new."""
        regex = guide_regex(*guide)
        with self._lock:
            if regex in self._indexes:
                self._indexes.move_to_end(regex)
                return self._indexes[regex][0]
            fut: Future = Future()
            self._indexes[regex] = (fut, 0)
        threading.Thread(target=self._run, args=(regex, fut), name="mii_async-guide", daemon=True).start()
        return fut

    def _run(self, regex: str, fut: Future) -> None:
        try:
            index, size = self._compile(regex)
        except CompileError as exc:
            fut.set_exception(exc)
            if not exc.lasting:
                with self._lock:
                    self._indexes.pop(regex, None)
            return
        fut.set_result((index, next(_AUTOMATON_KEYS)))
        with self._lock:
            if regex in self._indexes:
                self._indexes[regex] = (fut, size)
                self._bytes += size
            while self._bytes > GUIDE_CACHE_BYTES and len(self._indexes) > 1:
                self._bytes -= self._indexes.popitem(last=False)[1][1]

    def _compile(self, regex: str) -> tuple[Any, int]:
        with self._child_lock:
            proc = self._child or self._start()
            try:
                data = regex.encode("utf-8")
                proc.stdin.write(struct.pack("<I", len(data)) + data)
                proc.stdin.flush()
                deadline = time.monotonic() + self.timeout_s
                head = self._read(proc, 9, deadline)
                ok, size = struct.unpack("<BQ", head)
                payload = self._read(proc, size, deadline)
            except TimeoutError:
                self._stop_child()
                raise CompileError(f"compiling the guide took longer than {self.timeout_s:g} s", lasting=True) from None
            except (EOFError, OSError):
                code = proc.poll()
                self._stop_child()
                raise CompileError(f"the guide compiler exited ({code}) while compiling it", lasting=True) from None
        if not ok:
            raise CompileError(payload.decode("utf-8", "replace"), lasting=True)
        return pickle.loads(payload), len(payload)

    @staticmethod
    def _read(proc: subprocess.Popen, n: int, deadline: float) -> bytes:
        """n bytes of the child's answer, or TimeoutError at the deadline, or EOFError if it exited."""
        fd, chunks, got = proc.stdout.fileno(), [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _start(self) -> subprocess.Popen:
        # A process of its own, started fresh (not forked: the parent may hold CUDA and threads; not
        # multiprocessing's spawn, which would run the caller's unguarded main script again).
        cmd = [sys.executable, "-m", "mii_async.workers.guide_compiler", self.model_path, str(self.eos),
               ",".join(map(str, self.end_ids)), str(self.memory_bytes)]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        except OSError as exc:        # a passing condition: the next compile tries again
            raise CompileError(f"the guide compiler could not start: {exc}", lasting=False) from None
        self._child = proc
        return proc

    def _stop_child(self) -> None:
        proc, self._child = self._child, None
        if proc is not None:
            proc.kill()
            proc.wait(5)
            for f in (proc.stdin, proc.stdout):
                f.close()

    def close(self) -> None:
        """Kills the child (a compile in progress fails, and its thread then reaps the child)."""
        if self._child_lock.acquire(blocking=False):
            try:
                self._stop_child()
            finally:
                self._child_lock.release()
        elif (proc := self._child) is not None:
            proc.kill()


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
