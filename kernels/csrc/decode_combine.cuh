// What the split decode kernels (paged_attention_decode.cu, paged_attention_stream.cu, paged_attention_mma.cu)
// share: the grid's order, the start of a partition, the one-pass kernels' merge of their warps' states, and the
// flash-decoding reduce. Grid (num_kv_heads, num_seqs, num_splits); each block writes its partition's (max,
// sum, normalised output) for the G query heads of its KV head, in fp32, at part_* [(seq * Hq + head) *
// num_splits + split] (part_out × head_dim).
#pragma once
#include "common.cuh"

// A block's sequence and KV head. The KV heads are the grid's x, so a sequence's KV heads are neighbours in
// launch order and run at once; since the cache is [block, token, KV head, dim], they read each token's whole
// row together (8 KV heads × 256 bytes for Llama-3-8B). Compiled with MII_SEQ_MAJOR_GRID the grid is
// (num_seqs, num_kv_heads, num_splits) (KernelConfig.decode_grid = "sequences", for probes): the blocks running
// at once are then one KV head of many sequences, reading 256-byte pieces of rows far apart: 0–2% slower at
// 64–320 sequences on the H100 (docs/benchmarks.md). Both orders give the same bits.
#ifdef MII_SEQ_MAJOR_GRID
__device__ __forceinline__ int grid_seq() { return blockIdx.x; }
__device__ __forceinline__ int grid_kvh() { return blockIdx.y; }
__device__ __forceinline__ int grid_num_kv_heads() { return gridDim.y; }
#else
__device__ __forceinline__ int grid_seq() { return blockIdx.y; }
__device__ __forceinline__ int grid_kvh() { return blockIdx.x; }
__device__ __forceinline__ int grid_num_kv_heads() { return gridDim.x; }
#endif

#ifndef NEG_INF
#define NEG_INF (-3.0e38f)
#endif

// The tokens each split of a sequence reads: its span (the context, or the window) shared evenly by the grid's
// splits in whole 16-token tiles, at least `min_partition` and at most `partition` (what shared memory is sized
// for). So a sequence much shorter than the grid's context cap (a CUDA graph's) still spreads over the splits
// instead of leaving most of them empty; min_partition == partition keeps splits of `partition` tokens from the
// start, the last one short, and the later ones of a shorter sequence empty.
__device__ __forceinline__ int split_length(int span, int partition, int min_partition) {
  const int even = ((span + (int)gridDim.z - 1) / (int)gridDim.z + 15) & ~15;
  return min(partition, max(min_partition, even));
}

// Split i's weight in the combined softmax: sum_i * exp(max_i - max); 0 for an empty split or past the end.
__device__ __forceinline__ float split_weight(const float* pm, const float* ps, int i, int num_splits, float mx) {
  if (i >= num_splits) return 0.f;
  const float l = __ldcg(ps + i);
  return l > 0.f ? l * __expf(__ldcg(pm + i) - mx) : 0.f;
}

// A block's last phase in the one-pass kernels: kStates partial softmax states per query head (one per warp,
// or per row group of a warp) in shared memory, each a max (natural log) st_m[i * kMaxG + g], a sum st_l[…]
// and an unnormalised output st_acc[(i * kMaxG + g) * kHd + d], merged into the block's. With one split that
// is the output (rows out_row + g of `out`); otherwise the block's partition, published at
// part_row + g * num_splits for combine_if_last. A state with sum 0 (a warp that saw no token) weighs nothing.
template <typename D, int kStates, int kMaxG, int kHd, int kThreads>
__device__ __forceinline__ void merge_states(const float* st_m, const float* st_l, const float* st_acc, int G,
                                             long long out_row, typename D::T* __restrict__ out, long long part_row,
                                             int num_splits, float* __restrict__ part_out,
                                             float* __restrict__ part_max, float* __restrict__ part_sum) {
  for (int j = threadIdx.x; j < G * kHd; j += kThreads) {
    const int g = j / kHd, d = j % kHd;
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < kStates; ++i) mx = fmaxf(mx, st_m[i * kMaxG + g]);
    float total = 0.f, den = 0.f;
#pragma unroll
    for (int i = 0; i < kStates; ++i) {
      const float l = st_l[i * kMaxG + g];
      const float w = l > 0.f ? __expf(st_m[i * kMaxG + g] - mx) : 0.f;
      den += w * l;
      total += w * st_acc[(i * kMaxG + g) * kHd + d];
    }
    if (num_splits == 1) {
      out[(out_row + g) * kHd + d] = Cvt<D>::store(total / den);
    } else {
      part_out[(part_row + g * num_splits) * kHd + d] = total / den;
      if (d == 0) {
        part_max[part_row + g * num_splits] = mx;
        part_sum[part_row + g * num_splits] = den;
      }
    }
  }
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
  const int seq = grid_seq(), kvh = grid_kvh(), num_splits = gridDim.z;
  __threadfence();                               // this block's partition, visible before it counts
  __syncthreads();
  if (threadIdx.x == 0) {
    int* c = counters + (long long)seq * grid_num_kv_heads() + kvh;
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

// A partition's start in the one-pass kernels: its block ids into shared `blocks` (step inputs, read before the
// previous kernel is waited for), then the wait for that kernel; returns the partition's token count. A
// partition wholly past a shorter sequence's end publishes an empty state, takes its part in the combine and
// returns 0: the caller returns too.
template <typename D, int kThreads>
__device__ __forceinline__ int partition_start(const long long* __restrict__ block_tables,
                                               const long long* __restrict__ context_lens, long long* blocks,
                                               int start, int partition, int block_size, int max_blocks,
                                               long long part_row, int G, int num_q_heads, int head_dim,
                                               const float* part_out, float* part_max, float* part_sum,
                                               typename D::T* out, int* counters) {
  const int seq = grid_seq(), num_splits = gridDim.z;
  const int ctx = (int)context_lens[seq];
  const int b0 = start / block_size;
  const int b_end = min(max_blocks, (start + partition + block_size - 1) / block_size);
  for (int i = threadIdx.x; b0 + i < b_end; i += kThreads) blocks[i] = block_tables[(long long)seq * max_blocks + b0 + i];
  const int n = min(start + partition, ctx) - start;
  if (n <= 0) {
    pdl_wait();
    if (threadIdx.x < G) {
      part_max[part_row + threadIdx.x * num_splits] = NEG_INF;
      part_sum[part_row + threadIdx.x * num_splits] = 0.f;
    }
    combine_if_last<D>(part_out, part_max, part_sum, out, counters, num_q_heads, head_dim, G);
    return 0;
  }
  __syncthreads();
  pdl_wait();                                    // the queries and this step's K/V rows were just written
  return n;
}
