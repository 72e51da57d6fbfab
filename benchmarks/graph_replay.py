"""A benchmark's op captured in a CUDA graph the way the engine captures its decode steps: called once on a side
stream first (kernels compiled, the allocator warmed, nothing captured), then `calls` calls captured and the
graph replayed once, so that its first timed replay is a warm one."""
from __future__ import annotations

from collections.abc import Callable

import torch


def capture(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph
