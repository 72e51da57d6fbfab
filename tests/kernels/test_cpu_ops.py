"""The CPU backend's native ops (kernels/cpu.py, csrc/cpu/cpu_ops.c) against their torch definitions on random
data, outputs poisoned first: norms, the gated activations, rotary with the KV write, decode attention over a
paged cache (GQA, windows, soft-cap, scattered blocks); and what they do not take falls back to the reference."""
from __future__ import annotations

import os

import pytest
import torch
from mii_async.kernels import cpu_build, cpu_kernels_available, get_ops
from mii_async.kernels import reference as R
from mii_async.kernels.int_weight import quantize_int4, quantize_int8
from mii_async.kernels.metadata import AttentionMetadata

# Skipped only where there is no compiler, or the kernels are switched off: with a compiler, a library that fails
# to build fails the tests.
pytestmark = pytest.mark.skipif(cpu_build.compiler() is None or os.environ.get(cpu_build.ENV_DISABLE) == "0",
                                reason="no C compiler to build the CPU kernels, or MII_ASYNC_CPU_KERNELS=0")


def test_the_library_builds_where_a_compiler_is_found():
    assert cpu_kernels_available(), cpu_build.unavailable_reason()

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


@pytest.fixture(scope="module")
def C():
    return get_ops("cpu")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float())).item()


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 576), (7, 64), (3, 1000)])
def test_norms(C, dtype, tol, t, h):
    x, res, w = (torch.randn(t, h).to(dtype) for _ in range(3))
    assert rel(C.rms_norm(x, w[0], 1e-5), R.rms_norm(x, w[0], 1e-5)) < tol
    out, r = C.fused_add_rms_norm(x, res, w[0], 1e-6)
    want, want_r = R.fused_add_rms_norm(x, res, w[0], 1e-6)
    assert torch.equal(r, want_r) and rel(out, want) < tol


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_gated_activations(C, dtype, tol):
    x = torch.randn(5, 2 * 96).to(dtype) * 3
    assert rel(C.silu_and_mul(x), R.silu_and_mul(x)) < tol
    assert rel(C.gelu_tanh_and_mul(x), R.gelu_tanh_and_mul(x)) < tol


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("t", [1, 5])
def test_rotary_write_kv_from_one_qkv_row(C, dtype, tol, t):
    hq, hkv, d, bs, nblocks = 6, 2, 64, 16, 8
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    positions = torch.randint(0, 500, (t,))
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(512).float()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1)
    slots = torch.randperm(nblocks * bs)[:t]
    caches = [torch.full((nblocks, bs, hkv, d), float("nan"), dtype=dtype) for _ in range(4)]
    got = C.rotary_write_kv(positions, q, k, v, cos_sin, caches[0], caches[1], slots)
    want = R.rotary_write_kv(positions, q, k, v, cos_sin, caches[2], caches[3], slots)
    assert rel(got, want) < tol
    flat = [c.view(-1, hkv, d)[slots] for c in caches]
    assert rel(flat[0], flat[2]) < tol and torch.equal(flat[1], flat[3])
    assert torch.isnan(caches[0]).sum() == torch.isnan(caches[2]).sum()      # nothing else written


def _meta(context_lens: list[int], bs: int, nblocks: int) -> AttentionMetadata:
    """Decode rows only, each sequence's blocks drawn at random from the pool (not in order)."""
    width = max(-(-c // bs) for c in context_lens)
    perm = torch.randperm(nblocks)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int64)
    at = 0
    for i, c in enumerate(context_lens):
        n = -(-c // bs)
        tables[i, :n] = perm[at:at + n]
        at += n
    n = len(context_lens)
    return AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.int64), block_tables=tables,
                             context_lens=torch.tensor(context_lens), query_start_loc=torch.arange(n + 1),
                             num_decodes=n, max_context_len=max(context_lens), query_lens=[1] * n,
                             context_lens_host=list(context_lens))


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 30.0), (7, 50.0)])
def test_decode_attention_over_scattered_blocks(C, dtype, tol, hq, hkv, window, softcap):
    d, bs, nblocks = 64, 16, 64
    lens = [1, 17, 100, 333]
    kc, vc = torch.randn(nblocks, bs, hkv, d).to(dtype), torch.randn(nblocks, bs, hkv, d).to(dtype)
    q = torch.randn(len(lens), hq, d).to(dtype)
    meta = _meta(lens, bs, nblocks)
    got = C.paged_attention(q, kc, vc, meta, 0.125, torch.full_like(q, float("nan")), window, softcap)
    want = R.paged_attention(q, kc, vc, meta._replace(), 0.125, None, window, softcap)
    assert rel(got, want) < tol


def test_what_the_native_ops_do_not_take_runs_the_reference(C):
    """fp16 activations, non-contiguous rows and an FP8 cache take the reference, with its very results; the
    GEMMs are torch's."""
    x, w = torch.randn(3, 64).half(), torch.randn(64).half()
    assert torch.equal(C.rms_norm(x, w, 1e-5), R.rms_norm(x, w, 1e-5))
    xt = torch.randn(64, 3).t()                                 # [3, 64], columns apart
    assert torch.equal(C.silu_and_mul(xt), R.silu_and_mul(xt))
    w4, x2 = quantize_int4(torch.randn(32, 64), torch.bfloat16), torch.randn(2, 64).bfloat16()
    assert torch.equal(C.linear(x2, w4), R.linear(x2, w4))


def test_the_output_head_takes_the_engine_threads_in_a_one_thread_step(C):
    """The int8 head's GEMM (native, or torch's where the library has no AVX-512) runs on the engine's threads
    (set_head_threads) in a step set to one, and the step's thread count is back after it."""
    from mii_async.kernels import cpu

    w8, x = quantize_int8(torch.randn(4096, 64), torch.bfloat16), torch.randn(1, 64).bfloat16()
    seen = []
    before = torch.get_num_threads()
    real_split, real_linear = cpu._parallel, R.linear
    try:
        cpu._parallel = lambda n, op, threads=None, chunk=1: seen.append(threads) or real_split(n, op, threads, chunk)
        cpu.reference.linear = lambda *a: seen.append(torch.get_num_threads()) or real_linear(*a)
        cpu.set_head_threads(2)
        torch.set_num_threads(1)
        got = C.linear(x, w8)
        after = torch.get_num_threads()
    finally:
        cpu._parallel, cpu.reference.linear = real_split, real_linear
        torch.set_num_threads(before)
    assert seen == [2] and after == 1
    assert rel(got.float(), R.linear(x, w8).float()) < 1e-2
    q = torch.randn(2, 4, 64)
    kc = torch.randn(8, 16, 2, 64).to(torch.float8_e4m3fn)
    meta = _meta([5, 20], 16, 8)
    assert torch.equal(C.paged_attention(q, kc, kc, meta, 0.125), R.paged_attention(q, kc, kc, meta._replace(), 0.125))


@pytest.mark.parametrize("extra", [(), ("-mno-avx512bf16",)], ids=["native", "without-avx512bf16"])
def test_the_source_compiles_without_warnings(tmp_path, extra):
    """The C sources are warning-free under -Wall -Wextra with the flags the build uses, and (on x86) also where
    the CPU lacks AVX512-BF16 (the int4 GEMM's portable stub)."""
    import platform
    import subprocess

    from mii_async.kernels import cpu_build

    if extra and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 flag")
    cc = cpu_build.compiler()
    r = subprocess.run([cc, *cpu_build.FLAGS, *extra, "-Wall", "-Wextra", "-Werror", *map(str, cpu_build.SOURCES),
                        "-o", str(tmp_path / "t.so"), "-lm"], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("env,why", [({"MII_ASYNC_CPU_KERNELS": "0"}, "MII_ASYNC_CPU_KERNELS=0"),
                                     ({"CC": "false", "PATH": "/nonexistent"}, "no C compiler")])
def test_without_the_library_auto_runs_the_reference_and_says_why(tmp_path, env, why):
    """No library (turned off, or no compiler on PATH): "auto" resolves to the reference on the CPU, "cpu" is
    refused with the reason; the build cache is a fresh directory, so nothing built before is loaded."""
    import subprocess
    import sys

    code = ("from mii_async.kernels import resolve_backend\n"
            "from mii_async.kernels.cpu_build import unavailable_reason\n"
            "print(resolve_backend('auto', 'cpu'), '|', unavailable_reason())\n"
            "try:\n    resolve_backend('cpu', 'cpu')\nexcept ValueError as e:\n    print('refused:', e)\n")
    full = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env}
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=full,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    first, refused = r.stdout.splitlines()
    assert first.startswith("reference |") and why in first
    assert refused.startswith("refused: the cpu kernels are not available") and why in refused


def test_an_index_out_of_range_raises_and_writes_nothing(C):
    """A position past the rotary table, a slot past the cache, or a block id past the pool is an IndexError
    before anything is written, never a stray read or write."""
    hq, hkv, d, bs, nblocks = 4, 2, 64, 16, 4
    q, k, v = torch.randn(1, hq, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    cos_sin = torch.randn(32, d)
    kc, vc = torch.zeros(nblocks, bs, hkv, d), torch.zeros(nblocks, bs, hkv, d)
    for pos, slot in [(32, 0), (-1, 0), (0, nblocks * bs), (0, -1)]:
        with pytest.raises(IndexError, match="position or a KV slot"):
            C.rotary_write_kv(torch.tensor([pos]), q, k, v, cos_sin, kc, vc, torch.tensor([slot]))
    assert not kc.any() and not vc.any()
    meta = _meta([20], bs, nblocks)
    bad = meta._replace(block_tables=torch.tensor([[0, nblocks]]))
    out = torch.zeros(1, hq, d)
    with pytest.raises(IndexError, match="block id"):
        C.paged_attention(q, kc, vc, bad, 0.125, out)
    long = meta._replace(context_lens_host=[3 * bs])                 # more keys than its table holds
    with pytest.raises(IndexError, match="block id"):
        C.paged_attention(q, kc, vc, long, 0.125, out)
    assert not out.any()


def _team(total: int, chunk: int = 1, closed: int = 0):
    import ctypes

    return (ctypes.c_int64 * 6)(0, total, chunk, 0, closed, 0)      # next, total, chunk, active, closed, status


def test_a_team_shares_rows_and_a_late_helper_touches_nothing(C):
    """csrc/cpu/team.h: an owner alone takes every unit; a helper that arrives once the team is closed returns
    without writing; rows split over two threads give the one-thread bits; a bad block id fails the team."""
    import ctypes

    from mii_async.kernels import cpu

    lens, hq, hkv, d, bs, nblocks = [33, 1, 70, 16, 5, 90, 64], 9, 3, 64, 16, 48
    kc, vc = torch.randn(nblocks, bs, hkv, d).bfloat16(), torch.randn(nblocks, bs, hkv, d).bfloat16()
    q = torch.randn(len(lens), hq, d).bfloat16()
    meta = _meta(lens, bs, nblocks)
    lib, ctx = cpu._lib(), torch.tensor(lens)
    args = (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), nblocks, meta.block_tables.data_ptr(),
            meta.block_tables.shape[1], ctx.data_ptr())

    def run(team, owner):
        out = torch.full_like(q, float("nan"))
        rc = lib.decode_attention(*args, 0, len(lens), hq, hkv, d, bs, 0.125, 0, 0.0, 1, out.data_ptr(),
                                  ctypes.addressof(team) if team is not None else None, owner)
        return rc, out

    rc, alone = run(None, 1)
    assert rc == 0 and not torch.isnan(alone).any()
    rc, owned = run(_team(len(lens), 2), 1)
    assert rc == 0 and torch.equal(owned, alone)
    rc, late = run(_team(len(lens), 2, closed=1), 0)
    assert rc == 0 and torch.isnan(late).all()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        shared = C.paged_attention(q, kc, vc, meta, 0.125, torch.full_like(q, float("nan")))
        assert torch.equal(shared, alone)
        bad = _meta(lens, bs, nblocks)
        bad.block_tables[5, 0] = nblocks + 3
        with pytest.raises(IndexError, match="out of range"):
            C.paged_attention(q, kc, vc, bad, 0.125)
        assert torch.equal(C.paged_attention(q, kc, vc, meta, 0.125), alone)
    finally:
        torch.set_num_threads(before)


def test_every_c_file_and_header_is_installed_and_keys_the_build():
    """What the library is built from (its sources and the headers they include) ships in the package
    (pyproject's package-data) and counts in the build's cache key: no file of csrc/cpu is left out of either."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from mii_async.kernels import cpu_build

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "mii_async.kernels"]
    csrc = root / "kernels" / "csrc" / "cpu"
    on_disk = {p.name for p in csrc.iterdir() if p.suffix in (".c", ".h")}
    assert on_disk == {p.name for p in cpu_build.SOURCES + cpu_build.HEADERS}
    for name in on_disk:
        assert any(fnmatch.fnmatch(f"csrc/cpu/{name}", pat) for pat in patterns), name
