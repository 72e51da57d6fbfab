// e4m3 (FP8) in the kernels that read or write it: the FP8 GEMV's weights, the activation quantizer's output and
// an FP8 KV cache (kv_cache_dtype="fp8").
//
// Rounding to e4m3 is PTX's cvt (nearest even, saturated at ±448, sm_89 on), as torch rounds after the clamp the
// host applies. Widening needs no conversion instruction: an e4m3 byte moved into an f16's bits (sign to bit 15,
// exponent and mantissa one bit lower) is the same number times 2^-8, subnormals included; a reader carries the
// 2^8 on a scale it applies anyway (E4M3_UNIT), and the f16 → f32 step is one instruction on the FMA pipe.
#pragma once
#include "common.cuh"

typedef unsigned char e4m3_t;
struct E4M3 { typedef e4m3_t T; };
#define E4M3_UNIT 256.f          // a widened e4m3 times this is its value

__device__ __forceinline__ e4m3_t to_e4m3(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(pair) : "f"(v));   // both halves v: either byte is it
  return (e4m3_t)(pair & 0xffu);
#else
  return 0;     // FP8 needs sm_89 or later: the host never launches an FP8 kernel below it
#endif
}

// Two e4m3 bytes (bits 0-7 and 16-23 of w) → f16x2 (lo, hi), each 2^-8 times its value.
__device__ __forceinline__ unsigned widen_pair_lo(unsigned w) { return ((w << 8) & 0x80008000u) | ((w << 7) & 0x3f803f80u); }
// Bytes at bits 8-15 and 24-31 of w → f16x2, the same way.
__device__ __forceinline__ unsigned widen_pair_hi(unsigned w) { return (w & 0x80008000u) | ((w >> 1) & 0x3f803f80u); }

// Four e4m3 bytes (bytes 0..3 of w) → floats, each 2^-8 times its value.
__device__ __forceinline__ void widen4(unsigned w, float& e0, float& e1, float& e2, float& e3) {
  const unsigned a = widen_pair_lo(w), b = widen_pair_hi(w);   // bytes 0 and 2; 1 and 3
  e0 = f16_to_float((f16_t)(a & 0xffffu));
  e2 = f16_to_float((f16_t)(a >> 16));
  e1 = f16_to_float((f16_t)(b & 0xffffu));
  e3 = f16_to_float((f16_t)(b >> 16));
}

// The cache-element conversions of a KV cache in e4m3: load gives the exact value (one element at a time, off
// the hot loops), store rounds as torch's clamp-then-cast.
template <> struct Cvt<E4M3> {
  __device__ __forceinline__ static float load(e4m3_t x) {
    float e0, e1, e2, e3;
    widen4((unsigned)x, e0, e1, e2, e3);
    return e0 * E4M3_UNIT;
  }
  __device__ __forceinline__ static e4m3_t store(float f) { return to_e4m3(f); }
};
