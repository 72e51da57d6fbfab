// The flash-decoding reduce shared by the decode kernels (paged_attention_decode.cu,
// paged_attention_stream.cu): grid (num_seqs, num_kv_heads, num_splits); each block has written its
// partition's (max, sum, normalised output) for the G query heads of its KV head, in fp32, at
// part_* [(seq * Hq + head) * num_splits + split] (part_out × head_dim).
#pragma once
#include "common.cuh"

#ifndef NEG_INF
#define NEG_INF (-3.0e38f)
#endif

// Split i's weight in the combined softmax: sum_i * exp(max_i - max); 0 for an empty split or past the end.
__device__ __forceinline__ float split_weight(const float* pm, const float* ps, int i, int num_splits, float mx) {
  if (i >= num_splits) return 0.f;
  const float l = __ldcg(ps + i);
  return l > 0.f ? l * __expf(__ldcg(pm + i) - mx) : 0.f;
}

// The last block of a (sequence, KV head) to finish combines the partitions of its G query heads (the
// flash-decoding reduce, without a second kernel): every block publishes its (max, sum, output) and counts
// itself in; the one that counts last reads them all from L2, writes the output and resets the counter for the
// next launch (or graph replay).
template <typename D>
__device__ void combine_if_last(const float* __restrict__ part_out, const float* __restrict__ part_max,
                                const float* __restrict__ part_sum, typename D::T* __restrict__ out,
                                int* __restrict__ counters, int num_q_heads, int head_dim, int G) {
  __shared__ int last;
  const int seq = blockIdx.x, kvh = blockIdx.y, num_splits = gridDim.z;
  __threadfence();                               // this block's partition, visible before it counts
  __syncthreads();
  if (threadIdx.x == 0) {
    int* c = counters + (long long)seq * gridDim.y + kvh;
    last = atomicAdd(c, 1) == num_splits - 1;
    if (last) *c = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  // One warp per query head: lanes take 32 splits at a time for the max and the weights, then each lane sums
  // its head_dim / 32 dims of every split's output, with the split's weight passed by shuffle (the loads are
  // not behind the weight's branch, so that they pipeline; an unwritten output is loaded, never used).
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, per_lane = head_dim / 32;
  for (int g = warp; g < G; g += (int)(blockDim.x >> 5)) {
    const long long row = (long long)seq * num_q_heads + kvh * G + g;
    const float* pm = part_max + row * num_splits;
    const float* ps = part_sum + row * num_splits;
    float mx = NEG_INF;
    for (int i = lane; i < num_splits; i += 32) mx = fmaxf(mx, __ldcg(pm + i));   // an empty one: NEG_INF
    mx = warp_max(mx);
    // Head dim 128 (the common case): one float4 per lane and split, all splits' loads in flight at once.
    // Otherwise one dim at a time (a slower loop, for other head dims).
    const float* po = part_out + row * num_splits * head_dim;
    if (per_lane == 4) {
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f, den = 0.f;
      for (int c = 0; c < num_splits; c += 32) {
        const float w = split_weight(pm, ps, c + lane, num_splits, mx);
        den += w;
        const int m = min(32, num_splits - c);
#pragma unroll 4
        for (int k = 0; k < m; ++k) {
          const float wk = __shfl_sync(0xffffffffu, w, k);
          const float4 x = __ldcg(reinterpret_cast<const float4*>(po + (c + k) * head_dim) + lane);
          if (wk > 0.f) {                        // an empty partition weighs 0: its output was never written
            a0 += wk * x.x; a1 += wk * x.y; a2 += wk * x.z; a3 += wk * x.w;
          }
        }
      }
      den = warp_sum(den);
      typename D::T* o = out + row * head_dim + 4 * lane;
      o[0] = Cvt<D>::store(a0 / den); o[1] = Cvt<D>::store(a1 / den);
      o[2] = Cvt<D>::store(a2 / den); o[3] = Cvt<D>::store(a3 / den);
    } else {
      for (int e = 0; e < per_lane; ++e) {
        float acc = 0.f, den = 0.f;
        for (int c = 0; c < num_splits; c += 32) {
          const float w = split_weight(pm, ps, c + lane, num_splits, mx);
          den += w;
          const int m = min(32, num_splits - c);
          for (int k = 0; k < m; ++k) {
            const float wk = __shfl_sync(0xffffffffu, w, k);
            if (wk > 0.f) acc += wk * __ldcg(po + (c + k) * head_dim + lane * per_lane + e);
          }
        }
        out[row * head_dim + lane * per_lane + e] = Cvt<D>::store(acc / warp_sum(den));
      }
    }
  }
}

