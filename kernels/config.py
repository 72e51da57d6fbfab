"""KernelConfig: the CUDA kernels' tuning choices, frozen and passed whole.

The CUDA op set is bound to one config when it is built (`get_ops("cuda", config)`), so model code calls
`ops.paged_attention(...)` and never sees it; a probe that compares choices builds one op set per config.
Nothing here is read at import: `from_env` reads the documented environment variables when an entry point
asks it to. No torch: configs are built and checked on any machine.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DECODE_KERNELS = ("mma", "stream", "split")
GRID_ORDERS = ("kv_heads", "sequences")
PREFILL_KERNELS = ("flash", "cudnn")
ENV_DECODE_KERNEL = "MII_ASYNC_DECODE"
ENV_DECODE_GRID = "MII_ASYNC_DECODE_GRID"
ENV_PDL = "MII_ASYNC_PDL"
ENV_GEMV_PREFETCH = "MII_ASYNC_GEMV_PREFETCH"
ENV_PREFILL = "MII_ASYNC_PREFILL"


@dataclass(frozen=True)
class KernelConfig:
    # Decode attention's kernel (kernels/decode_attention.py): "mma" (tensor cores), "stream" (one scalar
    # pass) or "split" (two phases, every shape); each takes the next where it does not apply.
    decode_kernel: str = "mma"
    # Decode attention's launch order: "kv_heads" (grid (Hkv, S, splits): a sequence's KV heads run side by
    # side and read each cached token's whole row together) or "sequences" ((S, Hkv, splits), compiled apart,
    # for probes; the GPU tests check that both give the same bits).
    decode_grid: str = "kv_heads"
    # The mma kernel runs 2 warps a block (6 blocks an SM) instead of 4 (3) from this many (sequence, KV head)
    # pairs on; None: never, 0: always. None because the engine's mixed load measured no gain from the narrow
    # form (docs/benchmarks.md); the GPU tests pass at both widths.
    mma_narrow_from: int | None = None
    # Programmatic dependent launch while a CUDA graph is captured on Hopper (kernels/pdl.py): each kernel of
    # a step may start while the one before it finishes.
    pdl: bool = True
    # Bytes of its first weight rows (of each half, with a gated epilogue) that each block of a skinny GEMM
    # (gemv.cu, gemv_fp8.cu) asks L2 for before it waits on the kernel ahead of it; 0: none.
    gemv_prefetch: int = 16 << 10
    # Prompt chunks' attention (kernels/prefill_attention.py): "flash" (torch's variable-length flash attention,
    # a group of chunks a call, over keys gathered from the cache) or "cudnn" (cuDNN's fused attention over the
    # paged cache in place, every chunk of the step in one call; kernels/cudnn_prefill.py), which leaves to
    # flash what it does not take (an FP8 cache, a window, soft-capped scores) or where its frontend is absent.
    prefill_attention: str = "flash"

    def __post_init__(self) -> None:
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {', '.join(DECODE_KERNELS)}, got {self.decode_kernel!r}")
        if self.decode_grid not in GRID_ORDERS:
            raise ValueError(f"decode_grid must be one of {', '.join(GRID_ORDERS)}, got {self.decode_grid!r}")
        n = self.mma_narrow_from
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"mma_narrow_from must be None or an int >= 0, got {n!r}")
        if not isinstance(self.pdl, bool):
            raise ValueError(f"pdl must be true or false, got {self.pdl!r}")
        if self.prefill_attention not in PREFILL_KERNELS:
            raise ValueError(f"prefill_attention must be one of {', '.join(PREFILL_KERNELS)}, "
                             f"got {self.prefill_attention!r}")
        p = self.gemv_prefetch
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"gemv_prefetch must be an int >= 0 (bytes), got {p!r}")

    def mma_warps(self, pairs: int) -> int:
        """The mma kernel's block width, in warps, for a launch over `pairs` (sequence, KV head) pairs."""
        return 2 if self.mma_narrow_from is not None and pairs >= self.mma_narrow_from else 4

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KernelConfig:
        """The config the environment names: $MII_ASYNC_DECODE (decode_kernel), $MII_ASYNC_DECODE_GRID
        (decode_grid), $MII_ASYNC_PDL=0 (pdl off), $MII_ASYNC_GEMV_PREFETCH (gemv_prefetch, bytes),
        $MII_ASYNC_PREFILL (prefill_attention); the defaults for those unset. A bad value is refused naming its
        variable."""
        kernel = env.get(ENV_DECODE_KERNEL, cls.decode_kernel)
        if kernel not in DECODE_KERNELS:
            raise ValueError(f"{ENV_DECODE_KERNEL} must be one of {', '.join(DECODE_KERNELS)}, got {kernel!r}")
        grid = env.get(ENV_DECODE_GRID, cls.decode_grid)
        if grid not in GRID_ORDERS:
            raise ValueError(f"{ENV_DECODE_GRID} must be one of {', '.join(GRID_ORDERS)}, got {grid!r}")
        prefetch = env.get(ENV_GEMV_PREFETCH, str(cls.gemv_prefetch))
        if not prefetch.isdigit():
            raise ValueError(f"{ENV_GEMV_PREFETCH} must be a number of bytes >= 0, got {prefetch!r}")
        prefill = env.get(ENV_PREFILL, cls.prefill_attention)
        if prefill not in PREFILL_KERNELS:
            raise ValueError(f"{ENV_PREFILL} must be one of {', '.join(PREFILL_KERNELS)}, got {prefill!r}")
        return cls(decode_kernel=kernel, decode_grid=grid, pdl=env.get(ENV_PDL, "1") != "0",
                   gemv_prefetch=int(prefetch), prefill_attention=prefill)


DEFAULT = KernelConfig()
