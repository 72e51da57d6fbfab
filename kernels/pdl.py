"""Programmatic dependent launch (Hopper): a kernel launched with it may start while the kernel before it on the
stream is still finishing, and waits for it (`pdl_wait()` in csrc/common.cuh) only where it reads that kernel's
results. Our kernels read their weights (or the step's inputs) before the wait, so a decode step's chain of
small kernels overlaps each one's start with the previous one's tail.

CuPy launches through cuLaunchKernel, which takes no launch attributes, so this goes to the driver's
cuLaunchKernelEx through ctypes. kernels/cuda.py uses it while a CUDA graph is being captured (the graph then
holds programmatic edges; the per-launch ctypes cost is paid once, at capture). KernelConfig(pdl=False)
launches every kernel plainly.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6          # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CTYPE = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32,
          np.float32: ctypes.c_float}


class _Attribute(ctypes.Structure):             # CUlaunchAttribute: id, padding to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):                # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("numAttrs", ctypes.c_uint)]


@functools.cache
def _launch_kernel_ex():
    f = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    f.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f


def launch(function: int, grid: tuple, block: tuple, args: tuple, shared_mem: int, stream: int) -> None:
    """Launches the CUfunction `function` with programmatic stream serialization allowed. `args` are numpy
    scalars (np.uint64 for pointers), as CuPy takes them."""
    grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    values = [_CTYPE[type(a)](a.item()) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _Config(*grid, *block, shared_mem, stream, ctypes.pointer(attr), 1)
    rc = _launch_kernel_ex()(ctypes.byref(config), function, params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
