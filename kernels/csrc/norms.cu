// RMSNorm and fused residual-add + RMSNorm, one block per token row, fp32 accumulation.
// Rounding follows kernels/reference.py step by step: residual' = dtype(x + residual); normed =
// dtype(residual' * rsqrt(mean(residual'^2) + eps)); out = dtype(weight * normed).
#include "common.cuh"

template <typename D>
__device__ void rms_norm_row(const typename D::T* __restrict__ x, typename D::T* __restrict__ res_out,
                             const typename D::T* __restrict__ res_in, const typename D::T* __restrict__ w,
                             typename D::T* __restrict__ out, int hidden, float eps) {
  // x, res_in, res_out, out point at this row; res_in == nullptr: plain RMSNorm of x.
  extern __shared__ float row[];           // [hidden] the summed row in fp32 (already rounded to D)
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = Cvt<D>::load(x[i]);
    if (res_in != nullptr) {
      v = round_to<D>(v + Cvt<D>::load(res_in[i]));
      res_out[i] = Cvt<D>::store(v);
    }
    row[i] = v;
    ss += v * v;
  }
  float inv = rsqrtf(block_sum(ss) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float normed = round_to<D>(row[i] * inv);
    out[i] = Cvt<D>::store(Cvt<D>::load(w[i]) * normed);
  }
}

#define MII_NORMS(SUFFIX, D)                                                                                   \
  extern "C" __global__ void rms_norm_##SUFFIX(const D::T* x, const D::T* w, D::T* out, int hidden,           \
                                               long long x_stride, float eps) {                               \
    long long r = blockIdx.x;                                                                                  \
    rms_norm_row<D>(x + r * x_stride, nullptr, nullptr, w, out + r * hidden, hidden, eps);                    \
  }                                                                                                            \
  extern "C" __global__ void fused_add_rms_norm_##SUFFIX(const D::T* x, const D::T* res_in, const D::T* w,    \
                                                         D::T* out, D::T* res_out, int hidden,                \
                                                         long long x_stride, long long res_stride, float eps) { \
    long long r = blockIdx.x;                                                                                  \
    rms_norm_row<D>(x + r * x_stride, res_out + r * hidden, res_in + r * res_stride, w, out + r * hidden,      \
                    hidden, eps);                                                                              \
  }
MII_FOR_DTYPES(MII_NORMS)
