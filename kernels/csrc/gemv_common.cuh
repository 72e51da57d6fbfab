// What the skinny GEMMs (gemv.cu, gemv_fp8.cu, moe_gemv.cu) share: 16-bit values moved as 16-byte vectors of
// eight, weights streamed past L1, and the order in which a warp's steps visit W's rows.
#pragma once
#include "common.cuh"

#define PRO_NONE 0
#define PRO_NORM 1
#define EPI_NONE 0
#define EPI_SILU 1
#define EPI_GELU 2              // GeGLU: gelu_tanh(gate) * up (Gemma)

// The two elements of a 32-bit word of a 16-bit type, as floats.
template <typename D> __device__ __forceinline__ void split2(unsigned w, float& lo, float& hi);
template <> __device__ __forceinline__ void split2<BF16>(unsigned w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}
template <> __device__ __forceinline__ void split2<F16>(unsigned w, float& lo, float& hi) {
  lo = f16_to_float((f16_t)(w & 0xffffu));
  hi = f16_to_float((f16_t)(w >> 16));
}
template <typename D> __device__ __forceinline__ void unpack8(const uint4& r, float* f) {
  split2<D>(r.x, f[0], f[1]); split2<D>(r.y, f[2], f[3]); split2<D>(r.z, f[4], f[5]); split2<D>(r.w, f[6], f[7]);
}
template <typename D> __device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 r;
  typename D::T* e = reinterpret_cast<typename D::T*>(&r);
#pragma unroll
  for (int j = 0; j < 8; ++j) e[j] = Cvt<D>::store(f[j]);
  return r;
}

// Weights are read once: no L1 allocation.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Asks L2 for `bytes` (a multiple of 16) from p, the 32 lanes of a warp each a share, with Hopper's bulk
// prefetch: a skinny GEMM issues it for its block's first rows of W before pdl_wait, so that the card's memory
// stays busy through the previous kernel's tail instead of waiting for the block's first loads; the loads
// then find the rows in L2. A no-op before sm_90.
__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const long long piece = (bytes + 32 * 16 - 1) / (32 * 16) * 16;
  const long long off = lane * piece;
  if (off < bytes) {
    const unsigned n = (unsigned)min(piece, bytes - off);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(static_cast<const char*>(p) + off), "r"(n)
                 : "memory");
  }
#endif
}

// A block's share of W for prefetch_l2: its output rows [r0, r0 + rows) of `row_bytes` each (and with a gated
// epilogue the same rows of the up half, `half` rows on), at most `cap` bytes of each, from warp 0.
template <int EPI>
__device__ __forceinline__ void prefetch_block_rows(const void* w, long long r0, long long rows, long long outs,
                                                    long long row_bytes, long long cap, int warp, int lane) {
  if (warp != 0 || cap <= 0) return;
  rows = min(rows, outs - r0);
  if (rows <= 0) return;
  const long long bytes = min(rows * row_bytes, cap / 16 * 16);
  const char* base = static_cast<const char*>(w);
  prefetch_l2(base + r0 * row_bytes, bytes, lane);
  if (EPI != EPI_NONE) prefetch_l2(base + (outs + r0) * row_bytes, bytes, lane);
}

// The row of W that step s of a warp reads (groups steps per row): its (row0 + i)-th output row, or with a
// gated epilogue (EPI_SILU, EPI_GELU) gate row row0 + i and up row half + row0 + i in turn.
template <int EPI>
__device__ __forceinline__ long long step_row(long long row0, int s, int groups, long long half) {
  const int q = s / groups;
  return EPI != EPI_NONE ? row0 + (q >> 1) + ((q & 1) ? half : 0) : row0 + q;
}

// A gated epilogue's output from its gate and up rows (each already rounded to the storage type), rounded as
// activation.cu's SiLU-and-mul and torch's gelu(approximate="tanh") * up round them.
template <typename D, int EPI>
__device__ __forceinline__ float gated(float gate, float up) {
  if (EPI == EPI_GELU) {
    const float cube = gate * gate * gate;      // torch's order of operations
    const float inner = 0.7978845608028654f * (gate + 0.044715f * cube);
    return round_to<D>(0.5f * gate * (1.f + tanhf(inner))) * up;
  }
  return round_to<D>(gate / (1.f + __expf(-gate))) * up;
}
