// Skinny GEMMs over FP8 weights: y [M, N] = xin [M, K] · (W [N, K] e4m3 · scales)ᵀ (+ bias) for M = 1 … 4
// rows (the decode of a few sequences; FP8_GEMV_MAX_M in kernels/fp8_linear.py), where the time is reading W
// once: one byte a weight. The activations stay in the model dtype (no activation quantization: the weights are
// widened in registers), so the result is the reference's (kernels/reference.py dequantizes, then projects) up
// to the order of the sums and the reference's rounding of the dequantized weight to the model dtype.
// As gemv.cu (the bf16 one), a prologue builds xin inside the same kernel and an epilogue may finish the MLP's
// input:
//   PRO_NORM  xin = rms_norm(x + residual) (or of x alone), rounded as norms.cu rounds it; block 0 also writes
//             the summed residual
//   EPI_SILU  W is [gate | up] (N = 2F rows) and y [M, F] = silu(gate) * up, rounded as activation.cu rounds
//             it: a warp takes gate row j and up row F + j in turn
// Scales (compile-time FP8_BLOCK): 0: one fp32 a row [N]; 1: one a row and 128-column block, stored
// [ceil(K/128)][N] (kernels/fp8_weight.py), applied to each 16-byte chunk's partial sum; a warp's rows are
// consecutive, so a block's scales of its next rows are in the cache line it read. M is compile-time too (FP8_M): the
// host compiles the variants it launches.
//
// A lane reads 16-byte chunks of a row (16 weights), lane-interleaved, FP8_UNROLL at a time, the next group in
// flight while this one is multiplied. A weight is widened without a conversion instruction: its byte moved
// into an f16's bits (sign to bit 15, exponent and mantissa one bit lower) is the same number times 2^-8,
// subnormals included, and the 2^8 rides on the row's scale; two go per 32-bit word (e4m3 bytes 0 and 2, then 1
// and 3), and the f16 → f32 widening is one instruction on the FMA pipe. xin is kept in shared memory in fp32,
// laid out [M][4][K/16] float4s (piece j of chunk c at [j][c]), so that a warp's reads of one piece are
// consecutive (no bank conflicts) and need no unpacking.
// Only 16-bit activations (bf16, fp16); the host requires K % 16 == 0, 16-byte aligned rows and M·K·4 bytes of
// shared memory within its limit. The norm's per-warp sums follow xin in the same dynamic buffer (FP8_WARPS·M
// floats, FP8_GEMV_RED in kernels/fp8_linear.py): with no static shared memory, the host's dynamic request is
// the kernel's whole footprint, and launch.py raises the 48 KiB default by that request alone.
#include "fp8.cuh"
#include "gemv_common.cuh"

#ifndef FP8_M
#define FP8_M 1
#endif
#ifndef FP8_BLOCK
#define FP8_BLOCK 0
#endif
#define FP8_WARPS 8
#define FP8_UNROLL 8
#define FP8_THREADS (FP8_WARPS * 32)
#define STAGE 4                 // x chunks per thread in flight while staging
#define CHUNKS_PER_BLOCK 8      // 16-byte chunks of e4m3 in a 128-column scale block

// A group of a row's chunks, and with block scales each chunk's scale.
template <int EPI>
__device__ __forceinline__ void load_group(uint4 (&r)[FP8_UNROLL], float (&sc)[FP8_UNROLL], const uint4* __restrict__ w,
                                           const float* __restrict__ scale, long long row0, int s, int steps,
                                           int groups, int kc, int n, long long half, int lane) {
  const long long row = step_row<EPI>(row0, s, groups, half);
  const uint4* wr = w + row * kc;
  const int c0 = (s % groups) * FP8_UNROLL * 32 + lane;
#pragma unroll
  for (int u = 0; u < FP8_UNROLL; ++u) {
    const int c = c0 + u * 32;
    const bool in = s < steps && c < kc;
    if (in) r[u] = load_stream(wr + c);
    else r[u].x = r[u].y = r[u].z = r[u].w = 0u;
    if (FP8_BLOCK) sc[u] = in ? __ldg(scale + (long long)(c / CHUNKS_PER_BLOCK) * n + row) : 0.f;
  }
}

template <typename D, int PRO, int EPI>
__device__ void gemv_fp8(const typename D::T* __restrict__ x, long long x_stride, const typename D::T* __restrict__ res,
                         long long res_stride, const typename D::T* __restrict__ norm_w,
                         typename D::T* __restrict__ res_out, const unsigned char* __restrict__ w,
                         const float* __restrict__ scale, const typename D::T* __restrict__ bias,
                         void* __restrict__ y, long long y_stride, int out_f32, int n, int k, int rows_per_warp,
                         float eps, long long prefetch) {
  typedef typename D::T T;
  constexpr int M = FP8_M;
  extern __shared__ float4 xs[];                 // [M][4][kc] xin in fp32, then the norm's sums [FP8_WARPS][M]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kc = k / 16;
  const long long outs = EPI == EPI_SILU ? n / 2 : n;          // output rows
  const long long row0 = ((long long)blockIdx.x * FP8_WARPS + warp) * rows_per_warp;
  const int nrows = (int)max(0LL, min((long long)rows_per_warp, outs - row0));
  const int groups = (kc + FP8_UNROLL * 32 - 1) / (FP8_UNROLL * 32);
  const int steps = nrows * groups * (EPI == EPI_SILU ? 2 : 1);
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  uint4 cur[FP8_UNROLL];
  float csc[FP8_UNROLL];
  pdl_launch_dependents();
  load_group<EPI>(cur, csc, w4, scale, row0, 0, steps, groups, kc, n, outs, lane);   // weights only: the
  prefetch_block_rows<EPI>(w, (long long)blockIdx.x * FP8_WARPS * rows_per_warp,    // previous kernel may run
                           (long long)FP8_WARPS * rows_per_warp, outs, k, prefetch, warp, lane);
  pdl_wait();

  // xin: x's 16-byte chunks of 8 elements i (pieces 2(i%2) and 2(i%2)+1 of e4m3 chunk i/2), STAGE per thread
  // per pass, loads first. With the norm, the summed values first, then normed in place by the same thread.
  const int xc = k / 8;
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    ss[m] = 0.f;
    const uint4* xr = reinterpret_cast<const uint4*>(x + m * x_stride);
    const uint4* rr = reinterpret_cast<const uint4*>(res + m * res_stride);
    uint4* ro = reinterpret_cast<uint4*>(res_out + (long long)m * k);
    for (int i0 = threadIdx.x; i0 < xc; i0 += STAGE * FP8_THREADS) {
      uint4 xv[STAGE], rv[STAGE];
#pragma unroll
      for (int j = 0; j < STAGE; ++j) {
        const int i = i0 + j * FP8_THREADS;
        if (i < xc) {
          xv[j] = xr[i];
          if (PRO == PRO_NORM && res != nullptr) rv[j] = rr[i];
        }
      }
#pragma unroll
      for (int j = 0; j < STAGE; ++j) {
        const int i = i0 + j * FP8_THREADS;
        if (i >= xc) continue;
        float v[8];
        unpack8<D>(xv[j], v);
        if (PRO == PRO_NORM && res != nullptr) {
          float r[8];
          unpack8<D>(rv[j], r);
          uint4 o;
          T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            v[e] = round_to<D>(v[e] + r[e]);
            oe[e] = Cvt<D>::store(v[e]);
          }
          if (blockIdx.x == 0) ro[i] = o;
        }
        const int piece = (i & 1) * 2;
        xs[(m * 4 + piece) * kc + i / 2] = float4{v[0], v[1], v[2], v[3]};
        xs[(m * 4 + piece + 1) * kc + i / 2] = float4{v[4], v[5], v[6], v[7]};
        if (PRO == PRO_NORM) {
#pragma unroll
          for (int e = 0; e < 8; ++e) ss[m] += v[e] * v[e];
        }
      }
    }
  }
  if (PRO == PRO_NORM) {
    float (*red)[M] = reinterpret_cast<float (*)[M]>(xs + M * 4 * kc);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float s = warp_sum(ss[m]);
      if (lane == 0) red[warp][m] = s;
    }
    __syncthreads();
    const uint4* nw = reinterpret_cast<const uint4*>(norm_w);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float total = 0.f;
#pragma unroll
      for (int i = 0; i < FP8_WARPS; ++i) total += red[i][m];
      const float inv = rsqrtf(total / k + eps);
      for (int i = threadIdx.x; i < xc; i += FP8_THREADS) {      // the same thread wrote this chunk above
        float g[8];
        unpack8<D>(nw[i], g);
        const int piece = (i & 1) * 2;
        float4& a = xs[(m * 4 + piece) * kc + i / 2];
        float4& b = xs[(m * 4 + piece + 1) * kc + i / 2];
        a.x = round_to<D>(g[0] * round_to<D>(a.x * inv));
        a.y = round_to<D>(g[1] * round_to<D>(a.y * inv));
        a.z = round_to<D>(g[2] * round_to<D>(a.z * inv));
        a.w = round_to<D>(g[3] * round_to<D>(a.w * inv));
        b.x = round_to<D>(g[4] * round_to<D>(b.x * inv));
        b.y = round_to<D>(g[5] * round_to<D>(b.y * inv));
        b.z = round_to<D>(g[6] * round_to<D>(b.z * inv));
        b.w = round_to<D>(g[7] * round_to<D>(b.w * inv));
      }
    }
  }
  __syncthreads();

  float acc[M], gate[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = gate[m] = 0.f;
  for (int s = 0; s < steps; ++s) {
    uint4 nxt[FP8_UNROLL];
    float nsc[FP8_UNROLL];
    load_group<EPI>(nxt, nsc, w4, scale, row0, s + 1, steps, groups, kc, n, outs, lane);
    const int g = s % groups;
    const int c0 = g * FP8_UNROLL * 32 + lane;
#pragma unroll
    for (int u = 0; u < FP8_UNROLL; ++u) {
      const int c = c0 + u * 32;
      if (c < kc) {
        float part[M];
#pragma unroll
        for (int m = 0; m < M; ++m) part[m] = 0.f;
        const unsigned words[4] = {cur[u].x, cur[u].y, cur[u].z, cur[u].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          float e0, e1, e2, e3;
          widen4(words[q], e0, e1, e2, e3);
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const float4 xv = xs[(m * 4 + q) * kc + c];
            part[m] = fmaf(e0, xv.x, part[m]);
            part[m] = fmaf(e1, xv.y, part[m]);
            part[m] = fmaf(e2, xv.z, part[m]);
            part[m] = fmaf(e3, xv.w, part[m]);
          }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = FP8_BLOCK ? fmaf(part[m], csc[u], acc[m]) : acc[m] + part[m];
      }
      cur[u] = nxt[u];
      csc[u] = nsc[u];
    }
    if (g == groups - 1) {                       // the row is done: warp sums (every lane has them)
      const int q = s / groups;
      const long long row = step_row<EPI>(row0, s, groups, outs);
      const float rs = 256.f * (FP8_BLOCK ? 1.f : __ldg(scale + row));   // 2^8: the widening's factor
      const float b = bias != nullptr ? Cvt<D>::load(bias[row]) : 0.f;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float v = warp_sum(acc[m]) * rs + b;
        acc[m] = 0.f;
        if (EPI == EPI_SILU) {
          if ((q & 1) == 0) {                    // the gate row: kept for its up row, next
            gate[m] = round_to<D>(v);
            continue;
          }
          const float gm = gate[m];
          v = round_to<D>(gm / (1.f + __expf(-gm))) * round_to<D>(v);
        }
        const long long out_row = EPI == EPI_SILU ? row0 + (q >> 1) : row;
        if (lane == 0) {
          if (out_f32) reinterpret_cast<float*>(y)[m * y_stride + out_row] = round_to<D>(v);
          else reinterpret_cast<T*>(y)[m * y_stride + out_row] = Cvt<D>::store(v);
        }
      }
    }
  }
}

#define MII_GEMV_FP8_ONE(SUFFIX, D, PRO, EPI, NAME)                                                            \
  extern "C" __global__ void __launch_bounds__(FP8_THREADS, 1) gemv_fp8_##NAME##_##SUFFIX(                    \
      const D::T* x, long long x_stride, const D::T* res, long long res_stride, const D::T* norm_w,          \
      D::T* res_out, const unsigned char* w, const float* scale, const D::T* bias, void* y, long long y_stride, \
      int out_f32, int n, int k, int rows_per_warp, float eps, long long prefetch) {                          \
    gemv_fp8<D, PRO, EPI>(x, x_stride, res, res_stride, norm_w, res_out, w, scale, bias, y, y_stride, out_f32,  \
                          n, k, rows_per_warp, eps, prefetch);                                                 \
  }
#define MII_GEMV_FP8(SUFFIX, D)                                                                                \
  MII_GEMV_FP8_ONE(SUFFIX, D, PRO_NONE, EPI_NONE, plain)                                                       \
  MII_GEMV_FP8_ONE(SUFFIX, D, PRO_NORM, EPI_NONE, norm)                                                        \
  MII_GEMV_FP8_ONE(SUFFIX, D, PRO_NORM, EPI_SILU, norm_silu)
MII_GEMV_FP8(bf16, BF16)
MII_GEMV_FP8(f16, F16)
