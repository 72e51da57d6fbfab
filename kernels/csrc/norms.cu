// RMSNorm and fused residual-add + RMSNorm, one block per token row, fp32 accumulation.
// Rounding follows kernels/reference.py step by step: residual' = dtype(x + residual); normed =
// dtype(residual' * rsqrt(mean(residual'^2) + eps)); out = dtype(weight * normed).
// With `vec` (the hidden size and the row strides multiples of 16 bytes' worth of elements), each thread
// moves 16 bytes per load and store; otherwise one element at a time.
#include "common.cuh"

template <typename D>
__device__ void rms_norm_row(const typename D::T* __restrict__ x, typename D::T* __restrict__ res_out,
                             const typename D::T* __restrict__ res_in, const typename D::T* __restrict__ w,
                             typename D::T* __restrict__ out, int hidden, float eps, int vec) {
  // x, res_in, res_out, out point at this row; res_in == nullptr: plain RMSNorm of x.
  typedef typename D::T T;
  constexpr int V = 16 / sizeof(T);
  extern __shared__ float row[];           // [hidden] the summed row in fp32 (already rounded to D)
  pdl_launch_dependents();
  pdl_wait();
  float ss = 0.f;
  if (vec) {
    for (int i = threadIdx.x; i < hidden / V; i += blockDim.x) {
      uint4 xv = reinterpret_cast<const uint4*>(x)[i];
      const T* xe = reinterpret_cast<const T*>(&xv);
      float v[V];
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = Cvt<D>::load(xe[j]);
      if (res_in != nullptr) {
        uint4 rv = reinterpret_cast<const uint4*>(res_in)[i], ov;
        const T* re = reinterpret_cast<const T*>(&rv);
        T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          v[j] = round_to<D>(v[j] + Cvt<D>::load(re[j]));
          oe[j] = Cvt<D>::store(v[j]);
        }
        reinterpret_cast<uint4*>(res_out)[i] = ov;
      }
#pragma unroll
      for (int j = 0; j < V; ++j) {
        row[i * V + j] = v[j];
        ss += v[j] * v[j];
      }
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      float v = Cvt<D>::load(x[i]);
      if (res_in != nullptr) {
        v = round_to<D>(v + Cvt<D>::load(res_in[i]));
        res_out[i] = Cvt<D>::store(v);
      }
      row[i] = v;
      ss += v * v;
    }
  }
  float inv = rsqrtf(block_sum(ss) / hidden + eps);
  if (vec) {
    for (int i = threadIdx.x; i < hidden / V; i += blockDim.x) {
      uint4 wv = reinterpret_cast<const uint4*>(w)[i], ov;
      const T* we = reinterpret_cast<const T*>(&wv);
      T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
      for (int j = 0; j < V; ++j) oe[j] = Cvt<D>::store(Cvt<D>::load(we[j]) * round_to<D>(row[i * V + j] * inv));
      reinterpret_cast<uint4*>(out)[i] = ov;
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      float normed = round_to<D>(row[i] * inv);
      out[i] = Cvt<D>::store(Cvt<D>::load(w[i]) * normed);
    }
  }
}

#define MII_NORMS(SUFFIX, D)                                                                                   \
  extern "C" __global__ void rms_norm_##SUFFIX(const D::T* x, const D::T* w, D::T* out, int hidden,           \
                                               long long x_stride, float eps, int vec) {                      \
    long long r = blockIdx.x;                                                                                  \
    rms_norm_row<D>(x + r * x_stride, nullptr, nullptr, w, out + r * hidden, hidden, eps, vec);               \
  }                                                                                                            \
  extern "C" __global__ void fused_add_rms_norm_##SUFFIX(const D::T* x, const D::T* res_in, const D::T* w,    \
                                                         D::T* out, D::T* res_out, int hidden,                \
                                                         long long x_stride, long long res_stride, float eps, \
                                                         int vec) {                                           \
    long long r = blockIdx.x;                                                                                  \
    rms_norm_row<D>(x + r * x_stride, res_out + r * hidden, res_in + r * res_stride, w, out + r * hidden,      \
                    hidden, eps, vec);                                                                         \
  }
MII_FOR_DTYPES(MII_NORMS)
