"""What the GPU at hand can do, measured the way ../shared/device/README.md measured the H200 (copy 4.25 TB/s,
bf16 8192³ matmul 782 TFLOP/s): device-to-device copy bandwidth (bytes read + written) and the bf16 matmul
rate, each the median of many CUDA-event-timed runs after a warm-up. The benchmarks' floors are computed from
these, so that a run on another card is held to that card's floor."""
from __future__ import annotations

import torch

from .gemm_tiles import timer


def _median_seconds(fn, runs: int) -> float:
    """Median seconds of one fn() on the GPU (CUDA events), after one call that warms it up."""
    fn()
    torch.cuda.synchronize()
    return timer(torch.device("cuda"))(fn, runs)


def copy_bandwidth(nbytes: int = 1 << 30, runs: int = 20) -> float:
    """Bytes per second read plus written by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), runs)


def matmul_flops(n: int = 8192, runs: int = 20) -> float:
    """bf16 FLOP/s of an n³ matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / _median_seconds(lambda: a @ b, runs)


def measure() -> dict:
    """{"copy_tb_s", "matmul_tflop_s"} of the current GPU."""
    bw, fl = copy_bandwidth(), matmul_flops()
    torch.cuda.empty_cache()
    return {"copy_tb_s": bw / 1e12, "matmul_tflop_s": fl / 1e12}
