// Skinny GEMMs: y [M, N] = xin [M, K] · W [N, K]ᵀ (+ bias) for M = 1 or 2 rows (the decode of one or two
// sequences; GEMV_MAX_M in kernels/cuda.py), where the time is reading W once. A prologue builds xin inside
// the same kernel, and an epilogue may finish the MLP's input, so that a decode layer's norms and SiLU are not
// kernels of their own:
//   PRO_NORM  xin = rms_norm(x + residual) (or of x alone), rounded as norms.cu rounds it; block 0 also writes
//             the summed residual. With `pre_w`, x is first normed itself (xin = rms_norm(rms_norm(x, pre_w) +
//             residual)): Gemma's post-norm of the previous block, which so needs no kernel of its own
//   EPI_SILU  W is [gate | up] (N = 2F rows) and y [M, F] = silu(gate) * up, rounded as activation.cu rounds
//             it: a warp takes gate row j and up row F + j in turn
//   EPI_GELU  the same with gelu_tanh(gate) * up (Gemma's GeGLU), rounded as torch rounds it
// With `out_f32` the result is written as fp32 after rounding to the storage type: `linear(...).float()`.
//
// Each warp takes `rows_per_warp` consecutive output rows; the host sizes the grid so that every warp gets the
// same count (a row takes a warp microseconds at full load, so an uneven split would leave a tail). A row is
// read as lane-interleaved 16-byte chunks (512 B per warp load), GEMV_UNROLL per lane at a time, and the next
// group — of this row or the warp's next — is in flight while this one is multiplied. The block keeps xin in
// shared memory in the storage type; it builds it after issuing its first weight loads, so they overlap (and,
// under programmatic dependent launch, they overlap the previous kernel's tail too).
// Only 16-bit types (bf16, fp16); the host requires K % 8 == 0 and 16-byte aligned rows.
#include "gemv_common.cuh"

#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 8
#endif
#define GEMV_THREADS (GEMV_WARPS * 32)
#define STAGE 4                 // xin chunks per thread in flight while staging

template <int EPI>
__device__ __forceinline__ void load_group(uint4 (&r)[GEMV_UNROLL], const uint4* __restrict__ w, long long row0,
                                           int s, int steps, int groups, int kc, long long half, int lane) {
  const uint4* wr = w + step_row<EPI>(row0, s, groups, half) * kc;
  const int c0 = (s % groups) * GEMV_UNROLL * 32 + lane;
#pragma unroll
  for (int u = 0; u < GEMV_UNROLL; ++u) {
    const int c = c0 + u * 32;
    if (s < steps && c < kc) r[u] = load_stream(wr + c);
    else r[u].x = r[u].y = r[u].z = r[u].w = 0u;
  }
}

template <typename D, int M, int PRO, int EPI>
__device__ void gemv(const typename D::T* __restrict__ x, long long x_stride, const typename D::T* __restrict__ res,
                     long long res_stride, const typename D::T* __restrict__ norm_w,
                     typename D::T* __restrict__ res_out,
                     const typename D::T* __restrict__ w, const typename D::T* __restrict__ bias, void* __restrict__ y,
                     long long y_stride, int out_f32, int n, int k, int rows_per_warp, float eps,
                     const typename D::T* __restrict__ pre_w, float pre_eps, long long prefetch) {
  typedef typename D::T T;
  extern __shared__ uint4 xs[];                  // [M, kc] xin, 16-byte chunks
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kc = k / 8;
  const long long outs = EPI != EPI_NONE ? n / 2 : n;          // output rows
  const long long row0 = ((long long)blockIdx.x * GEMV_WARPS + warp) * rows_per_warp;
  const int nrows = (int)max(0LL, min((long long)rows_per_warp, outs - row0));
  const int groups = (kc + GEMV_UNROLL * 32 - 1) / (GEMV_UNROLL * 32);
  const int steps = nrows * groups * (EPI != EPI_NONE ? 2 : 1);
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  uint4 cur[GEMV_UNROLL];
  pdl_launch_dependents();
  load_group<EPI>(cur, w4, row0, 0, steps, groups, kc, outs, lane);   // weights only: the previous kernel may run
  prefetch_block_rows<EPI>(w, (long long)blockIdx.x * GEMV_WARPS * rows_per_warp, (long long)GEMV_WARPS * rows_per_warp,
                           outs, (long long)k * sizeof(T), prefetch, warp, lane);
  pdl_wait();

  // xin. The staging loops take STAGE chunks per thread per pass, loads first, so that they are in flight
  // together (a block's multiply waits on this).
  if (PRO == PRO_NORM) {
    __shared__ float red[GEMV_WARPS][M];
    // The pre-norm's scale of each row: a pass over x of its own (x is in L2 after the previous kernel).
    float inv_pre[M];
    if (pre_w != nullptr) {                      // block-uniform
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint4* xr = reinterpret_cast<const uint4*>(x + m * x_stride);
        float ss = 0.f;
        for (int c = threadIdx.x; c < kc; c += GEMV_THREADS) {
          float v[8];
          unpack8<D>(xr[c], v);
#pragma unroll
          for (int e = 0; e < 8; ++e) ss += v[e] * v[e];
        }
        ss = warp_sum(ss);
        if (lane == 0) red[warp][m] = ss;
      }
      __syncthreads();
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float total = 0.f;
#pragma unroll
        for (int i = 0; i < GEMV_WARPS; ++i) total += red[i][m];
        inv_pre[m] = rsqrtf(total / k + pre_eps);
      }
      __syncthreads();                           // red is reused below
    }
    const uint4* pw = reinterpret_cast<const uint4*>(pre_w);
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      ss[m] = 0.f;
      const uint4* xr = reinterpret_cast<const uint4*>(x + m * x_stride);
      const uint4* rr = reinterpret_cast<const uint4*>(res + m * res_stride);
      uint4* ro = reinterpret_cast<uint4*>(res_out + (long long)m * k);
      for (int c0 = threadIdx.x; c0 < kc; c0 += STAGE * GEMV_THREADS) {
        uint4 xv[STAGE], rv[STAGE];
#pragma unroll
        for (int j = 0; j < STAGE; ++j) {
          const int c = c0 + j * GEMV_THREADS;
          if (c < kc) {
            xv[j] = xr[c];
            if (res != nullptr) rv[j] = rr[c];
          }
        }
#pragma unroll
        for (int j = 0; j < STAGE; ++j) {
          const int c = c0 + j * GEMV_THREADS;
          if (c >= kc) continue;
          float v[8];
          unpack8<D>(xv[j], v);
          if (pre_w != nullptr) {                // x → rms_norm(x, pre_w), rounded as norms.cu rounds it
            float g[8];
            unpack8<D>(pw[c], g);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = round_to<D>(g[e] * round_to<D>(v[e] * inv_pre[m]));
            xv[j] = pack8<D>(v);
          }
          if (res != nullptr) {
            float r[8];
            unpack8<D>(rv[j], r);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = round_to<D>(v[e] + r[e]);
            xv[j] = pack8<D>(v);
            if (blockIdx.x == 0) ro[c] = xv[j];
          }
          xs[m * kc + c] = xv[j];
#pragma unroll
          for (int e = 0; e < 8; ++e) ss[m] += v[e] * v[e];
        }
      }
    }
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
      for (int i = 0; i < GEMV_WARPS; ++i) total += red[i][m];
      const float inv = rsqrtf(total / k + eps);
      for (int c = threadIdx.x; c < kc; c += GEMV_THREADS) {     // the same thread wrote this chunk above
        float v[8], g[8];
        unpack8<D>(xs[m * kc + c], v);
        unpack8<D>(nw[c], g);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = g[e] * round_to<D>(v[e] * inv);
        xs[m * kc + c] = pack8<D>(v);
      }
    }
  } else {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const uint4* xr = reinterpret_cast<const uint4*>(x + m * x_stride);
      for (int c0 = threadIdx.x; c0 < kc; c0 += STAGE * GEMV_THREADS) {
        uint4 xv[STAGE];
#pragma unroll
        for (int j = 0; j < STAGE; ++j)
          if (c0 + j * GEMV_THREADS < kc) xv[j] = xr[c0 + j * GEMV_THREADS];
#pragma unroll
        for (int j = 0; j < STAGE; ++j)
          if (c0 + j * GEMV_THREADS < kc) xs[m * kc + c0 + j * GEMV_THREADS] = xv[j];
      }
    }
  }
  __syncthreads();

  float acc[M], gate[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = gate[m] = 0.f;
  for (int s = 0; s < steps; ++s) {
    uint4 nxt[GEMV_UNROLL];
    load_group<EPI>(nxt, w4, row0, s + 1, steps, groups, kc, outs, lane);
    const int g = s % groups;
    const int c0 = g * GEMV_UNROLL * 32 + lane;
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      const int c = c0 + u * 32;
      if (c < kc) {
        float wf[8];
        unpack8<D>(cur[u], wf);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float xf[8];
          unpack8<D>(xs[m * kc + c], xf);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[m] = fmaf(wf[j], xf[j], acc[m]);
        }
      }
      cur[u] = nxt[u];
    }
    if (g == groups - 1) {                       // the row is done: warp sums (every lane has them)
      const int q = s / groups;
      const long long row = step_row<EPI>(row0, s, groups, outs);
      const float b = bias != nullptr ? Cvt<D>::load(bias[row]) : 0.f;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float v = warp_sum(acc[m]) + b;
        acc[m] = 0.f;
        if (EPI != EPI_NONE) {
          if ((q & 1) == 0) {                    // the gate row: kept for its up row, next
            gate[m] = round_to<D>(v);
            continue;
          }
          v = gated<D, EPI>(gate[m], round_to<D>(v));
        }
        const long long out_row = EPI != EPI_NONE ? row0 + (q >> 1) : row;
        if (lane == 0) {
          if (out_f32) reinterpret_cast<float*>(y)[m * y_stride + out_row] = round_to<D>(v);
          else reinterpret_cast<T*>(y)[m * y_stride + out_row] = Cvt<D>::store(v);
        }
      }
    }
  }
}

#define MII_GEMV_ONE(SUFFIX, D, M, PRO, EPI, NAME)                                                             \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2) gemv_##NAME##_m##M##_##SUFFIX(               \
      const D::T* x, long long x_stride, const D::T* res, long long res_stride, const D::T* norm_w,          \
      D::T* res_out, const D::T* w, const D::T* bias, void* y, long long y_stride, int out_f32, int n, int k, \
      int rows_per_warp, float eps, const D::T* pre_w, float pre_eps, long long prefetch) {                    \
    gemv<D, M, PRO, EPI>(x, x_stride, res, res_stride, norm_w, res_out, w, bias, y, y_stride, out_f32, n, k,   \
                         rows_per_warp, eps, pre_w, pre_eps, prefetch);                                        \
  }
#define MII_GEMV_M(SUFFIX, D, M)                                                                               \
  MII_GEMV_ONE(SUFFIX, D, M, PRO_NONE, EPI_NONE, plain)                                                        \
  MII_GEMV_ONE(SUFFIX, D, M, PRO_NORM, EPI_NONE, norm)                                                         \
  MII_GEMV_ONE(SUFFIX, D, M, PRO_NORM, EPI_SILU, norm_silu)                                                    \
  MII_GEMV_ONE(SUFFIX, D, M, PRO_NORM, EPI_GELU, norm_gelu)
#define MII_GEMV(SUFFIX, D)                                                                                    \
  MII_GEMV_M(SUFFIX, D, 1) MII_GEMV_M(SUFFIX, D, 2)
MII_GEMV(bf16, BF16)
MII_GEMV(f16, F16)
