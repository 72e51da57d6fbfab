"""Compiling and launching the CUDA kernels of csrc/ from torch: CuPy compiles each .cu once per process (NVRTC,
the device's own arch) and keeps the binaries in its on-disk cache; every launch goes on torch's current stream,
and while a graph is captured on Hopper through programmatic dependent launch (pdl.py)."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from .pdl import launch as _launch_programmatic

CSRC = Path(__file__).parent / "csrc"
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@functools.cache
def _module(name: str, defines: tuple[str, ...] = ()):
    import cupy as cp

    major, minor = torch.cuda.get_device_capability()
    arch = f"-arch=sm_{major}{minor}"
    return cp.RawModule(code=(CSRC / f"{name}.cu").read_text(),
                        options=("--std=c++17", f"-I{CSRC}", arch, *(f"-D{d}" for d in defines)))


@functools.cache
def _kernel(module: str, name: str, dtype: torch.dtype, defines: tuple[str, ...] = ()):
    return _module(module, defines).get_function(f"{name}_{SUFFIX[dtype]}")


class _StreamHandle:
    """A raw cudaStream_t under the CUDA stream protocol, which CuPy ≥ 14 takes in place of ExternalStream."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


@functools.cache
def _stream(handle: int, device: int):
    import cupy as cp

    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is None:                       # CuPy 13
        return cp.cuda.ExternalStream(handle, device)
    with cp.cuda.Device(device):
        return from_external(_StreamHandle(handle))


@functools.cache
def sm_count() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@functools.cache
def _pdl_capable(device: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


@functools.cache
def resident_blocks(module: str, name: str, dtype: torch.dtype, threads: int, shared_mem: int,
                    defines: tuple[str, ...] = ()) -> int:
    """Blocks of kernel `name` (`threads` wide, `shared_mem` dynamic bytes) that one SM holds at once, from the
    driver's occupancy calculator; 0 where this CuPy does not expose it."""
    import cupy as cp

    k = _kernel(module, name, dtype, defines)
    if shared_mem > 48 * 1024:
        k.max_dynamic_shared_size_bytes = shared_mem
    occupancy = getattr(cp.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor", None)
    return int(occupancy(k.kernel.ptr, threads, shared_mem)) if occupancy is not None else 0


def launch(module: str, name: str, dtype: torch.dtype, grid: tuple, block: tuple, args: tuple,
           shared_mem: int = 0, defines: tuple[str, ...] = (), pdl: bool = True) -> None:
    """Launches kernel `name` of csrc/`module`.cu for `dtype`; `defines`: macros the module is compiled with
    (each set of them a module of its own); `pdl`: through programmatic dependent launch while a graph is
    captured on Hopper (KernelConfig.pdl)."""
    k = _kernel(module, name, dtype, defines)
    if shared_mem > 48 * 1024:
        k.max_dynamic_shared_size_bytes = shared_mem
    stream = torch.cuda.current_stream()
    if pdl and torch.cuda.is_current_stream_capturing() and _pdl_capable(stream.device_index):
        _launch_programmatic(k.kernel.ptr, grid, block, args, shared_mem, stream.cuda_stream)
        return
    with _stream(stream.cuda_stream, stream.device_index):
        k(grid, block, args, shared_mem=shared_mem)
