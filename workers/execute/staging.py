"""Staging: persistent pinned host buffers through which a step's inputs go to the GPU.

A fresh pinned buffer per step (`tensor.pin_memory()`) would go through torch's caching host allocator, which
calls `cudaHostAlloc` whenever it holds no free block of the size asked for, as a load's inputs grow or while
the block of the step in flight is still in use; a page-locked allocation is one of the calls CUDA lists as
synchronizing. So a few pinned buffers are allocated once and used in turn, each reused only after
the event recorded behind its last copy has passed (at once: by then the step in flight and the one before it
have read their inputs). A slot that is too small grows by doubling: the mixed load's steps fit the first
size; long contexts' block tables (256 sequences × 2,048 blocks is 4 MiB) grow it once.
"""
from __future__ import annotations

import numpy as np
import torch

SLOTS = 3                       # steps in flight under async scheduling (2), and one more
INITIAL_WORDS = 1 << 17         # 1 MiB of int64 a slot


class Staging:
    def __init__(self, device: torch.device, slots: int = SLOTS, words: int = INITIAL_WORDS) -> None:
        self.device = device
        self.hosts = [torch.empty(words, dtype=torch.int64, pin_memory=True) for _ in range(slots)]
        self.events = [torch.cuda.Event() for _ in range(slots)]    # one not yet recorded has passed
        self.turn = 0
        self.grown = 0

    def upload(self, buf: np.ndarray) -> torch.Tensor:
        """`buf` (int64) on the device, copied through the next slot; returns a new device tensor."""
        i, n = self.turn, len(buf)
        self.turn = (i + 1) % len(self.hosts)
        self.events[i].synchronize()               # its last copy has run (at once, but never assumed)
        host = self.hosts[i]
        if host.numel() < n:
            host = self.hosts[i] = torch.empty(max(n, 2 * host.numel()), dtype=torch.int64, pin_memory=True)
            self.grown += 1
        host.numpy()[:n] = buf
        out = host[:n].to(self.device, non_blocking=True)
        self.events[i].record()
        return out
