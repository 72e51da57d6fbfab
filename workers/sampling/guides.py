"""Guided generation in a replica: requests held while their guide compiles (workers/sampling/guide_compiler.py), one
outlines-core Guide per request walking its automaton, and the masks that keep each step's choice inside it.

A mask is a state's allowed tokens as bits, written by outlines-core on the host. Many steps of a request sit
in the same state (inside a JSON string, say), so the words are kept per (automaton, state), least recently
used dropped past `MASK_CACHE_ENTRIES`; a step then copies the rows up once and unpacks them on the device.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import numpy as np
import torch

from .guide_compiler import GuideCompiler

MASK_CACHE_ENTRIES = 4096


class RequestGuide:
    """One request's walk through its automaton."""
    __slots__ = ("guide", "key")

    def __init__(self, index: Any, key: int) -> None:
        from outlines_core import Guide

        self.guide, self.key = Guide(index), key

    def advance(self, token_id: int) -> bool:
        """Moves on by the token read; False if the automaton refuses it."""
        try:
            self.guide.advance(token_id, return_tokens=False)
        except Exception:  # noqa: BLE001 - outlines-core's own error types
            return False
        return True


_masks: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()   # (automaton, state) → its words
_masks_lock = threading.Lock()       # engines of one process (pipelines, tests) share the table


def _words(g: RequestGuide, words: int) -> np.ndarray:
    key = (g.key, g.guide.get_state())
    with _masks_lock:
        row = _masks.get(key)
        if row is not None:
            _masks.move_to_end(key)
            return row
    row = np.empty(words, np.int32)
    g.guide.write_mask_into(row.ctypes.data, words, 4)
    with _masks_lock:
        _masks[key] = row
        if len(_masks) > MASK_CACHE_ENTRIES:
            _masks.popitem(last=False)
    return row


def guide_masks(guides: list[RequestGuide], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Each guide's allowed next tokens as a bool mask [len(guides), vocab_size] on `device`; ids the
    tokenizer does not have are never allowed."""
    words = (vocab_size + 31) // 32
    host = np.stack([_words(g, words) for g in guides])
    if device.type != "cuda":
        bits = np.unpackbits(host.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits.view(np.bool_))
    up = torch.from_numpy(host).pin_memory().to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((up[:, :, None] >> shifts) & 1).bool().view(len(guides), -1)[:, :vocab_size]


class GuidedRequests:
    """Guided requests whose automaton is still compiling: held out of the scheduler until it is ready."""

    def __init__(self, compiler: GuideCompiler) -> None:
        self.compiler = compiler
        self.pending: dict[int, tuple[Any, Future]] = {}    # req_id → (Sequence, Future of (Index, key))

    def hold(self, seq: Any) -> None:
        self.pending[seq.req_id] = (seq, self.compiler.index(seq.params.guide))

    def drop(self, req_id: int) -> bool:
        entry = self.pending.pop(req_id, None)
        if entry is None:
            return False
        self.compiler.release(entry[1])     # a compile that nobody waits for any more is skipped
        return True

    def ready(self) -> tuple[list[Any], list[tuple[Any, str, str | None]]]:
        """The held sequences whose automaton is ready, each with its guide set, in arrival order; and those
        whose compile failed, with the reason and, where the same guide would always fail (outlines-core
        refuses the regex, or its automaton outgrows the limits), the guide's field. Both leave the hold."""
        admitted, failed = [], []
        for req_id, (seq, fut) in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[req_id]
            self.compiler.release(fut)
            if (exc := fut.exception()) is not None:
                failed.append((seq, str(exc), seq.params.guide[0] if getattr(exc, "lasting", False) else None))
            else:
                seq.guide = RequestGuide(*fut.result())
                admitted.append(seq)
        return admitted, failed

    def wait(self, timeout_s: float) -> None:
        """Until one held request's compile is done, or `timeout_s`."""
        futures = [f for _, f in self.pending.values()]
        if futures:
            wait(futures, timeout_s, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        self.compiler.close()
