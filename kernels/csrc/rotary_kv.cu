// Rotary embedding fused with the KV-cache write. One block per token: rotate-half (HF Llama) rotary on the
// token's query heads (written to q_out) and key heads (written straight into the cache at the token's slot),
// and its value heads copied into the cache. cos_sin is [max_pos, D] fp32 holding [cos | sin] of D/2
// frequencies. q, k, v rows may be strided (views of one fused QKV projection); heads are D apart.
// rotary_norm_write_kv first takes an RMSNorm of each q and k head (Qwen3, Gemma 3), a warp a head and a few
// warps a block (grid (T, head groups): a decode token's heads run side by side, not in turns), summed and
// rounded as norms.cu does a row of D (one warp, eight consecutive elements a lane), so that it equals the norm
// kernel followed by rotary_write_kv bit for bit; it takes D = 16 · 2^n up to 256, where each element's rotary
// partner (i ± D/2) sits in the lane D/16 away.
// Compiled with MII_KV_FP8 the cache is e4m3 (kv_cache_dtype="fp8"): each rotated key and each value is rounded
// to the model dtype first and then to e4m3, as the reference's rotary in the model dtype and its cache store do.
#include "common.cuh"
#include "fp8.cuh"

#ifdef MII_KV_FP8
#define KV(D) E4M3
#else
#define KV(D) D
#endif

// f (a value of the op in the model dtype D) as the element of a tensor of type O: rounded to D, then to O.
template <typename D, typename O>
__device__ __forceinline__ typename O::T store_as(float f) { return Cvt<O>::store(round_to<D>(f)); }

template <typename D, typename O>
__device__ __forceinline__ void rotate(const typename D::T* src, typename O::T* dst, const float* cs, int half,
                                       int i) {
  // Element pair (i, i + half) of one head, rounded as the reference rounds: cos and sin cast to the dtype,
  // each product rounded, then their sum.
  float c = round_to<D>(cs[i]), s = round_to<D>(cs[half + i]);
  float x1 = Cvt<D>::load(src[i]), x2 = Cvt<D>::load(src[i + half]);
  dst[i] = store_as<D, O>(round_to<D>(x1 * c) + round_to<D>(-x2 * s));
  dst[i + half] = store_as<D, O>(round_to<D>(x2 * c) + round_to<D>(x1 * s));
}

#define MII_ROTARY_KV(SUFFIX, D)                                                                               \
  extern "C" __global__ void rotary_write_kv_##SUFFIX(                                                         \
      const long long* positions, const D::T* q, const D::T* k, const D::T* v, const float* cos_sin,         \
      D::T* q_out, KV(D)::T* k_cache, KV(D)::T* v_cache, const long long* slot_mapping, int num_q_heads,     \
      int num_kv_heads, int head_dim, long long q_stride, long long k_stride, long long v_stride) {           \
    long long t = blockIdx.x;                                                                                  \
    int half = head_dim / 2;                                                                                   \
    pdl_launch_dependents();                                                                                   \
    const float* cs = cos_sin + positions[t] * head_dim;     /* step inputs: read before the wait */          \
    long long slot = slot_mapping[t];                                                                          \
    pdl_wait();                                                                                                \
    long long kv_row = slot * num_kv_heads * head_dim;                                                         \
    for (int j = threadIdx.x; j < num_q_heads * half; j += blockDim.x) {                                       \
      int h = j / half, i = j % half;                                                                          \
      rotate<D, D>(q + t * q_stride + h * head_dim, q_out + (t * num_q_heads + h) * head_dim, cs, half, i);   \
    }                                                                                                          \
    for (int j = threadIdx.x; j < num_kv_heads * half; j += blockDim.x) {                                      \
      int h = j / half, i = j % half;                                                                          \
      rotate<D, KV(D)>(k + t * k_stride + h * head_dim, k_cache + kv_row + h * head_dim, cs, half, i);        \
    }                                                                                                          \
    for (int j = threadIdx.x; j < num_kv_heads * head_dim; j += blockDim.x)                                    \
      v_cache[kv_row + j] = store_as<D, KV(D)>(Cvt<D>::load(v[t * v_stride + j]));                            \
  }
MII_FOR_DTYPES(MII_ROTARY_KV)

template <typename D, typename O>
__device__ __forceinline__ void norm_rotate_head(const typename D::T* __restrict__ src,
                                                 typename O::T* __restrict__ dst, const typename D::T* __restrict__ w,
                                                 const float* cs, int head_dim, float eps, int lane) {
  const int per = head_dim / 8, half = head_dim / 2;
  float v[8], ss = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = lane < per ? Cvt<D>::load(src[8 * lane + j]) : 0.f;
    ss += v[j] * v[j];
  }
  const float inv = rsqrtf(warp_sum(ss) / head_dim + eps);
#pragma unroll
  for (int j = 0; j < 8; ++j)
    v[j] = lane < per ? round_to<D>(Cvt<D>::load(w[8 * lane + j]) * round_to<D>(v[j] * inv)) : 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float partner = __shfl_xor_sync(0xffffffffu, v[j], half / 8);
    const int e = 8 * lane + j;
    if (lane >= per) continue;
    if (e < half) {
      const float c = round_to<D>(cs[e]), s = round_to<D>(cs[half + e]);
      dst[e] = store_as<D, O>(round_to<D>(v[j] * c) + round_to<D>(-partner * s));
    } else {
      const float c = round_to<D>(cs[e - half]), s = round_to<D>(cs[e]);
      dst[e] = store_as<D, O>(round_to<D>(v[j] * c) + round_to<D>(partner * s));
    }
  }
}

#define MII_ROTARY_NORM_KV(SUFFIX, D)                                                                          \
  extern "C" __global__ void rotary_norm_write_kv_##SUFFIX(                                                    \
      const long long* positions, const D::T* q, const D::T* k, const D::T* v, const float* cos_sin,         \
      D::T* q_out, KV(D)::T* k_cache, KV(D)::T* v_cache, const long long* slot_mapping, int num_q_heads,     \
      int num_kv_heads, int head_dim, long long q_stride, long long k_stride, long long v_stride,             \
      const D::T* q_norm, const D::T* k_norm, float eps) {                                                     \
    long long t = blockIdx.x;                                                                                  \
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;                                                \
    pdl_launch_dependents();                                                                                   \
    const float* cs = cos_sin + positions[t] * head_dim;     /* step inputs: read before the wait */          \
    long long slot = slot_mapping[t];                                                                          \
    pdl_wait();                                                                                                \
    long long kv_row = slot * num_kv_heads * head_dim;                                                         \
    const int heads = num_q_heads + num_kv_heads;                                                              \
    for (int h = blockIdx.y * warps + (threadIdx.x >> 5); h < heads; h += gridDim.y * warps) {                 \
      if (h < num_q_heads)                                                                                     \
        norm_rotate_head<D, D>(q + t * q_stride + h * head_dim, q_out + (t * num_q_heads + h) * head_dim,      \
                            q_norm, cs, head_dim, eps, lane);                                                  \
      else                                                                                                     \
        norm_rotate_head<D, KV(D)>(k + t * k_stride + (h - num_q_heads) * head_dim,                            \
                            k_cache + kv_row + (h - num_q_heads) * head_dim, k_norm, cs, head_dim, eps, lane); \
    }                                                                                                          \
    if (blockIdx.y == 0)                                                                                       \
      for (int j = threadIdx.x; j < num_kv_heads * head_dim; j += blockDim.x)                                  \
        v_cache[kv_row + j] = store_as<D, KV(D)>(Cvt<D>::load(v[t * v_stride + j]));                          \
  }
MII_FOR_DTYPES(MII_ROTARY_NORM_KV)
