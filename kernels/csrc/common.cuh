// Scalar types and conversions shared by every kernel. No CUDA headers are included, so that the same source
// compiles under NVRTC (CuPy) and nvcc alike: bf16 and fp16 are carried as their 16-bit patterns and converted
// with PTX. Each kernel is instantiated for float, bf16 and fp16 through the MII_FOR_DTYPES macro.
#pragma once

typedef unsigned short bf16_t;   // bfloat16 bit pattern
typedef unsigned short f16_t;    // IEEE half bit pattern

struct BF16 { typedef bf16_t T; };
struct F16 { typedef f16_t T; };
struct F32 { typedef float T; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float bf16_to_float(bf16_t x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ float f16_to_float(f16_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
}
__device__ __forceinline__ bf16_t float_to_bf16(float f) {
  bf16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));   // round to nearest even, as torch does
  return h;
}
__device__ __forceinline__ f16_t float_to_f16(float f) {
  f16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

template <typename D> struct Cvt;
template <> struct Cvt<F32> {
  __device__ __forceinline__ static float load(float x) { return x; }
  __device__ __forceinline__ static float store(float f) { return f; }
};
template <> struct Cvt<BF16> {
  __device__ __forceinline__ static float load(bf16_t x) { return bf16_to_float(x); }
  __device__ __forceinline__ static bf16_t store(float f) { return float_to_bf16(f); }
};
template <> struct Cvt<F16> {
  __device__ __forceinline__ static float load(f16_t x) { return f16_to_float(x); }
  __device__ __forceinline__ static f16_t store(float f) { return float_to_f16(f); }
};

// Rounds a float to the storage type and back: the value torch holds after an op in that dtype.
template <typename D> __device__ __forceinline__ float round_to(float f) { return Cvt<D>::load(Cvt<D>::store(f)); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  int nwarps = blockDim.x >> 5;
  v = (threadIdx.x < nwarps) ? partial[threadIdx.x] : 0.f;
  if (warp == 0) v = warp_sum(v);
  if (threadIdx.x == 0) partial[0] = v;
  __syncthreads();
  v = partial[0];
  __syncthreads();
  return v;
}

// Programmatic dependent launch (kernels/pdl.py): launched with it, a kernel may start before the one ahead of
// it on the stream has finished. pdl_wait() blocks until that one is done and its writes are visible: a kernel
// calls it before it reads anything an earlier kernel of the step wrote, and before its first global write.
// Before it, only weights and the step's inputs (copied in ahead of the step's first kernel) may be read.
// pdl_launch_dependents() lets the next kernel start as this one's blocks finish. Both are no-ops in a plain
// launch.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define MII_FOR_DTYPES(MACRO) MACRO(f32, F32) MACRO(bf16, BF16) MACRO(f16, F16)
