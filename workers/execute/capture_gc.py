"""Python's cyclic garbage collector held off while CUDA graphs are captured.

A collection may start inside any allocation of the capturing thread (a ctypes launch argument is enough), and
the finalizers of what it frees (the tensors, CUDA graphs, streams and pinned buffers of an engine that is no
longer referenced) call into CUDA: under a capture in global mode such a call is refused, and a refusal in a
destructor aborts the process. So the garbage is collected once before the captures, and none during them.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_held() -> Iterator[None]:
    """A full collection, then the collector off until the block ends (on again only if it was on)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
