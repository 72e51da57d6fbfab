// SiLU-and-mul: x [T, 2F] = [gate | up] → out [T, F] = dtype(dtype(silu(gate)) * up), as the reference rounds.
#include "common.cuh"

#define MII_SILU(SUFFIX, D)                                                                                    \
  extern "C" __global__ void silu_and_mul_##SUFFIX(const D::T* x, D::T* out, int ffn, long long x_stride) {   \
    long long r = blockIdx.y;                                                                                  \
    const D::T* gate = x + r * x_stride;                                                                       \
    const D::T* up = gate + ffn;                                                                               \
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < ffn; i += gridDim.x * blockDim.x) {               \
      float g = Cvt<D>::load(gate[i]);                                                                         \
      float s = round_to<D>(g / (1.f + __expf(-g)));                                                           \
      out[r * ffn + i] = Cvt<D>::store(s * Cvt<D>::load(up[i]));                                               \
    }                                                                                                          \
  }
MII_FOR_DTYPES(MII_SILU)
