// Rotary embedding fused with the KV-cache write. One block per token: rotate-half (HF Llama) rotary on the
// token's query heads (written to q_out) and key heads (written straight into the cache at the token's slot),
// and its value heads copied into the cache. cos_sin is [max_pos, D] fp32 holding [cos | sin] of D/2
// frequencies. q, k, v rows may be strided (views of one fused QKV projection); heads are D apart.
#include "common.cuh"

template <typename D>
__device__ __forceinline__ void rotate(const typename D::T* src, typename D::T* dst, const float* cs, int half,
                                       int i) {
  // Element pair (i, i + half) of one head, rounded as the reference rounds: cos and sin cast to the dtype,
  // each product rounded, then their sum.
  float c = round_to<D>(cs[i]), s = round_to<D>(cs[half + i]);
  float x1 = Cvt<D>::load(src[i]), x2 = Cvt<D>::load(src[i + half]);
  dst[i] = Cvt<D>::store(round_to<D>(x1 * c) + round_to<D>(-x2 * s));
  dst[i + half] = Cvt<D>::store(round_to<D>(x2 * c) + round_to<D>(x1 * s));
}

#define MII_ROTARY_KV(SUFFIX, D)                                                                               \
  extern "C" __global__ void rotary_write_kv_##SUFFIX(                                                         \
      const long long* positions, const D::T* q, const D::T* k, const D::T* v, const float* cos_sin,         \
      D::T* q_out, D::T* k_cache, D::T* v_cache, const long long* slot_mapping, int num_q_heads,             \
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
      rotate<D>(q + t * q_stride + h * head_dim, q_out + (t * num_q_heads + h) * head_dim, cs, half, i);      \
    }                                                                                                          \
    for (int j = threadIdx.x; j < num_kv_heads * half; j += blockDim.x) {                                      \
      int h = j / half, i = j % half;                                                                          \
      rotate<D>(k + t * k_stride + h * head_dim, k_cache + kv_row + h * head_dim, cs, half, i);               \
    }                                                                                                          \
    for (int j = threadIdx.x; j < num_kv_heads * head_dim; j += blockDim.x)                                    \
      v_cache[kv_row + j] = v[t * v_stride + j];                                                               \
  }
MII_FOR_DTYPES(MII_ROTARY_KV)
