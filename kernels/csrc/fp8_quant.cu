// FP8 e4m3 quantization of activations before an FP8 GEMM (torch._scaled_mm), one block per token row; the
// residual add and RMSNorm before a projection may be its prologue, so that the normed row is never written in
// the model dtype. As kernels/fp8_weight.py's quantize_activations defines it:
//   scale = max(amax · (1/448), MIN_SCALE) per token (`group` == k) or per token and group of 128 columns (`group`
//   == 128, beside block-scaled weights), or the checkpoint's static scale; q = e4m3(v / scale), rounded to
//   nearest even, saturated at ±448.
// Per-token scales are written [T], group scales [G, T] (token-major within a group: the layout
// torch._scaled_mm takes for 1x128 scales, transposed).
//   PRO_NORM  v = rms_norm(x + residual) (or of x alone), rounded as norms.cu rounds it; the summed residual is
//             written
//   PRO_SILU  x is a row of [gate | up] (2k wide) and v = silu(gate) * up, rounded as activation.cu rounds it: the
//             down projection's input, never written in the model dtype
// The row is held in dynamic shared memory in fp32 between the passes, with the block reductions' 32 partials
// after it ((k + 32) · 4 bytes: QUANT_SMEM_EXTRA in kernels/fp8_linear.py). The kernel has no static shared
// memory, so that the host's dynamic request is its whole footprint: launch.py raises the block's limit above
// the 48 KiB default by that request alone.
#include "fp8.cuh"
#include "gemv_common.cuh"

#define PRO_SILU 2
#define INV_E4M3_MAX (1.f / 448.f)     // amax times this, as kernels/fp8_weight.py (and torch on a GPU) compute it
#define MIN_SCALE (1.f / (448.f * 512.f))
#define GROUP 128

// Max (MAX) or sum over the block (blockDim.x a multiple of 32, at most 1024) through `partial` [32];
// every thread gets the result.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* partial) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = MAX ? warp_max(v) : warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int nwarps = blockDim.x >> 5;
  v = (threadIdx.x < nwarps) ? partial[threadIdx.x] : 0.f;
  if (warp == 0) v = MAX ? warp_max(v) : warp_sum(v);
  if (threadIdx.x == 0) partial[0] = v;
  __syncthreads();
  v = partial[0];
  __syncthreads();
  return v;
}

template <typename D, int PRO>
__device__ void quant_row(const typename D::T* __restrict__ x, long long x_stride,
                          const typename D::T* __restrict__ res, long long res_stride, const typename D::T* __restrict__ norm_w,
                          typename D::T* __restrict__ res_out, unsigned char* __restrict__ q,
                          float* __restrict__ scale, const float* __restrict__ static_scale, int k, int group, int t,
                          float eps) {
  extern __shared__ float row[];              // [k], then the reductions' partials [32]
  float* partial = row + k;
  const long long r = blockIdx.x;
  x += r * x_stride;
  pdl_launch_dependents();
  pdl_wait();
  float ss = 0.f;
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    float v = Cvt<D>::load(x[i]);
    if (PRO == PRO_SILU) v = round_to<D>(gated<D, EPI_SILU>(v, Cvt<D>::load(x[k + i])));
    if (PRO == PRO_NORM && res != nullptr) {
      v = round_to<D>(v + Cvt<D>::load(res[r * res_stride + i]));
      res_out[r * k + i] = Cvt<D>::store(v);
    }
    row[i] = v;
    ss += v * v;
  }
  if (PRO == PRO_NORM) {
    const float inv = rsqrtf(block_reduce<false>(ss, partial) / k + eps);
    for (int i = threadIdx.x; i < k; i += blockDim.x)       // this thread's own elements
      row[i] = round_to<D>(Cvt<D>::load(norm_w[i]) * round_to<D>(row[i] * inv));
  }
  __syncthreads();
  unsigned char* qr = q + r * k;
  if (static_scale != nullptr || group >= k) {
    float s;
    if (static_scale != nullptr) {
      s = *static_scale;
    } else {
      float amax = 0.f;
      for (int i = threadIdx.x; i < k; i += blockDim.x) amax = fmaxf(amax, fabsf(row[i]));
      s = fmaxf(block_reduce<true>(amax, partial) * INV_E4M3_MAX, MIN_SCALE);
    }
    if (threadIdx.x == 0) scale[r] = s;
    for (int i = threadIdx.x; i < k; i += blockDim.x) qr[i] = to_e4m3(row[i] / s);
    return;
  }
  // Groups of GROUP columns: a warp each, 4 columns a lane.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int ngroups = (k + GROUP - 1) / GROUP;
  for (int g = warp; g < ngroups; g += nwarps) {
    float v[4], amax = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = g * GROUP + j * 32 + lane;
      v[j] = i < k ? row[i] : 0.f;
      amax = fmaxf(amax, fabsf(v[j]));
    }
    const float s = fmaxf(warp_max(amax) * INV_E4M3_MAX, MIN_SCALE);
    if (lane == 0) scale[(long long)g * t + r] = s;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = g * GROUP + j * 32 + lane;
      if (i < k) qr[i] = to_e4m3(v[j] / s);
    }
  }
}

#define MII_QUANT(SUFFIX, D)                                                                                   \
  extern "C" __global__ void quant_rows_##SUFFIX(const D::T* x, long long x_stride, unsigned char* q,          \
                                                  float* scale, const float* static_scale, int k, int group,    \
                                                  int t) {                                                      \
    quant_row<D, PRO_NONE>(x, x_stride, nullptr, 0, nullptr, nullptr, q, scale, static_scale, k, group, t, 0.f); \
  }                                                                                                             \
  extern "C" __global__ void norm_quant_rows_##SUFFIX(                                                         \
      const D::T* x, long long x_stride, const D::T* res, long long res_stride, const D::T* norm_w,            \
      D::T* res_out, unsigned char* q, float* scale, const float* static_scale, int k, int group, int t,       \
      float eps) {                                                                                              \
    quant_row<D, PRO_NORM>(x, x_stride, res, res_stride, norm_w, res_out, q, scale, static_scale, k, group, t, \
                           eps);                                                                                \
  }                                                                                                             \
  extern "C" __global__ void silu_quant_rows_##SUFFIX(const D::T* x, long long x_stride, unsigned char* q,     \
                                                       float* scale, const float* static_scale, int k,          \
                                                       int group, int t) {                                      \
    quant_row<D, PRO_SILU>(x, x_stride, nullptr, 0, nullptr, nullptr, q, scale, static_scale, k, group, t, 0.f); \
  }
MII_FOR_DTYPES(MII_QUANT)
