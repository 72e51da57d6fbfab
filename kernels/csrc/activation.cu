// SiLU-and-mul: x [T, 2F] = [gate | up] → out [T, F] = dtype(dtype(silu(gate)) * up), as the reference rounds.
// Grid (x blocks per row, T rows). With `vec` (F and the row stride multiples of 16 bytes' worth of elements),
// each thread moves 16 bytes per load and store; otherwise one element at a time.
#include "common.cuh"

template <typename D>
__device__ __forceinline__ float silu_mul(typename D::T g_raw, typename D::T u_raw) {
  float g = Cvt<D>::load(g_raw);
  float s = round_to<D>(g / (1.f + __expf(-g)));
  return s * Cvt<D>::load(u_raw);
}

template <typename D>
__device__ void silu_and_mul_row(const typename D::T* gate, const typename D::T* up, typename D::T* out, int ffn,
                                 int vec) {
  typedef typename D::T T;
  pdl_launch_dependents();
  pdl_wait();
  const int step = gridDim.x * blockDim.x;
  const int first = blockIdx.x * blockDim.x + threadIdx.x;
  if (vec) {
    constexpr int V = 16 / sizeof(T);
    const uint4* g4 = reinterpret_cast<const uint4*>(gate);
    const uint4* u4 = reinterpret_cast<const uint4*>(up);
    uint4* o4 = reinterpret_cast<uint4*>(out);
    for (int i = first; i < ffn / V; i += step) {
      uint4 gv = g4[i], uv = u4[i], ov;
      const T* ge = reinterpret_cast<const T*>(&gv);
      const T* ue = reinterpret_cast<const T*>(&uv);
      T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
      for (int j = 0; j < V; ++j) oe[j] = Cvt<D>::store(silu_mul<D>(ge[j], ue[j]));
      o4[i] = ov;
    }
  } else {
    for (int i = first; i < ffn; i += step) out[i] = Cvt<D>::store(silu_mul<D>(gate[i], up[i]));
  }
}

#define MII_SILU(SUFFIX, D)                                                                                    \
  extern "C" __global__ void silu_and_mul_##SUFFIX(const D::T* x, D::T* out, int ffn, long long x_stride,     \
                                                   int vec) {                                                 \
    long long r = blockIdx.y;                                                                                  \
    silu_and_mul_row<D>(x + r * x_stride, x + r * x_stride + ffn, out + r * ffn, ffn, vec);                    \
  }
MII_FOR_DTYPES(MII_SILU)
