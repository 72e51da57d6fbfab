"""Guided generation in a replica: a request's regex (mii_async/guided.py) compiled against the tokenizer's
vocabulary into a token automaton (outlines-core's Index), one Guide per request walking it, and the masks
that keep each step's choice inside it.

Compiling takes from milliseconds (a small schema) to seconds (JSON mode's bounded-depth regex, ~5 s for a 49k
vocabulary). It runs on a thread of its own (outlines-core releases the GIL), each regex once per process;
the engine holds a request back until its automaton is ready, so no step waits for a compile.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import torch

from mii_async.guided import guide_regex

MAX_INDEXES = 64                 # compiled automata kept per process, least recently used dropped


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
    """Each ordinary token's bytes → its ids (special tokens left out: a guide never allows them). ByteLevel
    vocabularies (GPT-2, Llama 3, Qwen2, SmolLM) map through GPT-2's byte alphabet; SentencePiece ones (Llama 2,
    Mistral) write a space as ▁ and raw bytes as <0xHH>."""
    special = set(getattr(tokenizer, "all_special_ids", []))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and "ByteLevel" in type(backend.decoder).__name__ + repr(backend.decoder)
    dec = _byte_decoder() if byte_level else {}
    out: dict[bytes, list[int]] = {}
    for tok, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if byte_level and all(c in dec for c in tok):
            b = bytes(dec[c] for c in tok)
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            b = bytes([int(tok[3:5], 16)])
        else:
            b = tok.replace("▁", " ").encode("utf-8")
        if b:
            out.setdefault(b, []).append(i)
    return out


class GuideCompiler:
    """Regex → Future of its compiled Index, for one model's tokenizer; each regex is compiled once."""

    def __init__(self, model_path: str | Path, end_ids: Iterable[int]) -> None:
        self.model_path, self.end_ids = str(model_path), frozenset(end_ids)
        self._vocabulary: Any = None
        self._indexes: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mii_async-guides")

    def index(self, guide: tuple[str, Any]) -> Future:
        """The Index of a request's guide ((field, value) of its params), compiling it if it is new."""
        regex = guide_regex(*guide)
        with self._lock:
            fut = self._indexes.pop(regex, None)      # a failure is kept too: the same regex fails again
            if fut is None:
                fut = self._pool.submit(self._compile, regex)
            self._indexes[regex] = fut                  # most recently used last
            while len(self._indexes) > MAX_INDEXES:
                self._indexes.pop(next(iter(self._indexes)))
            return fut

    def _compile(self, regex: str) -> Any:
        from outlines_core import Index, Vocabulary

        if self._vocabulary is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_path)
            # The end id a complete output may take: the tokenizer's EOS if the model ends on it.
            eos = tok.eos_token_id if tok.eos_token_id in self.end_ids else min(self.end_ids)
            vocab = {b: [i for i in ids if i not in self.end_ids] for b, ids in token_bytes(tok).items()}
            self._vocabulary = Vocabulary(eos, {b: ids for b, ids in vocab.items() if ids})
        try:
            return Index(regex, self._vocabulary)
        except Exception as exc:  # noqa: BLE001 - outlines-core's own error types
            raise ValueError(f"the guide cannot be compiled for this model's vocabulary: {exc}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def guide_masks(guides: list[Any], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Each guide's allowed next tokens as a bool mask [len(guides), vocab_size] on `device` (ids the
    tokenizer does not have are never allowed). The bits are written on the host by outlines-core, copied up
    in one queued copy, and unpacked on the device."""
    words = (vocab_size + 31) // 32
    bits = torch.empty((len(guides), words), dtype=torch.int32, pin_memory=device.type == "cuda")
    for row, g in zip(bits, guides):
        row.zero_()
        g.write_mask_into(row.data_ptr(), words, 4)
    bits = bits.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((bits[:, :, None] >> shifts) & 1).bool().view(len(guides), -1)[:, :vocab_size]


class GuidedRequests:
    """Guided requests whose automaton is still compiling: held out of the scheduler until it is ready."""

    def __init__(self, compiler: GuideCompiler) -> None:
        self.compiler = compiler
        self.pending: dict[int, tuple[Any, Future]] = {}    # req_id → (Sequence, Future of its Index)

    def hold(self, seq: Any) -> None:
        self.pending[seq.req_id] = (seq, self.compiler.index(seq.params.guide))

    def drop(self, req_id: int) -> bool:
        return self.pending.pop(req_id, None) is not None

    def ready(self) -> tuple[list[Any], list[tuple[Any, str]]]:
        """The held sequences whose automaton is ready, each with its Guide set, in arrival order; and those
        whose compile failed, with the reason. Both leave the hold."""
        from outlines_core import Guide

        admitted, failed = [], []
        for req_id, (seq, fut) in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[req_id]
            if (exc := fut.exception()) is not None:
                failed.append((seq, str(exc)))
            else:
                seq.guide = Guide(fut.result())
                admitted.append(seq)
        return admitted, failed

    def wait(self, timeout_s: float) -> None:
        """Until one held request's compile is done, or `timeout_s`."""
        futures = [f for _, f in self.pending.values()]
        if futures:
            from concurrent.futures import FIRST_COMPLETED, wait

            wait(futures, timeout_s, return_when=FIRST_COMPLETED)
