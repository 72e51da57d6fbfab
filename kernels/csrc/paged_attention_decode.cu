// Paged attention for decode (one query token per sequence) over the blocked KV cache, split over the context
// (flash-decoding) so that few sequences with long contexts still fill the GPU.
//
// Grid (num_seqs, num_kv_heads, num_splits), NUM_THREADS threads. One block takes one KV head, the G = Hq/Hkv
// query heads that share it (GQA: each K/V row is read once for all G), and one partition of PARTITION context
// tokens. Scores, softmax and the weighted sum of V are in fp32. With one split the block writes the output;
// otherwise it writes its partition's (max, sum, normalised output) and paged_attention_reduce combines them.
// Caches are [num_blocks, block_size, Hkv, D]; block_tables [num_seqs, max_blocks] int64; context_lens int64.
#include "common.cuh"

#define NUM_THREADS 128
#define MAX_G 16
#define NEG_INF (-3.0e38f)

__device__ __forceinline__ float block_max(float v, float* red) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = NEG_INF;
  for (int i = 0; i < NUM_THREADS / 32; ++i) v = fmaxf(v, red[i]);
  __syncthreads();
  return v;
}

__device__ __forceinline__ float block_total(float v, float* red) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = 0.f;
  for (int i = 0; i < NUM_THREADS / 32; ++i) v += red[i];
  __syncthreads();
  return v;
}

template <typename D>
__device__ void decode_partition(const typename D::T* __restrict__ q, const typename D::T* __restrict__ k_cache,
                                 const typename D::T* __restrict__ v_cache, const long long* __restrict__ block_tables,
                                 const long long* __restrict__ context_lens, typename D::T* __restrict__ out,
                                 float* __restrict__ part_out, float* __restrict__ part_max,
                                 float* __restrict__ part_sum, int num_q_heads, int num_kv_heads, int head_dim,
                                 int block_size, int max_blocks, int partition, float scale) {
  const int seq = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
  const int G = num_q_heads / num_kv_heads;
  const int ctx = (int)context_lens[seq];
  const int start = split * partition;
  const int end = min(start + partition, ctx);
  const long long part_row = ((long long)seq * num_q_heads + kvh * G) * num_splits + split;  // head g adds g*num_splits
  if (start >= ctx) {                           // an empty partition of a shorter sequence
    if (threadIdx.x < G) {
      part_max[part_row + threadIdx.x * num_splits] = NEG_INF;
      part_sum[part_row + threadIdx.x * num_splits] = 0.f;
    }
    return;
  }
  extern __shared__ float smem[];
  float* q_s = smem;                            // [G, D] the queries, fp32
  float* scores = q_s + G * head_dim;           // [G, partition]
  long long* rows = (long long*)(scores + G * partition);   // [partition] cache row of each token
  float* red = (float*)(rows + partition);      // [32] reductions
  float* acc_s = red + 32;                      // [groups, G, D] partial outputs
  const long long kv_stride = (long long)num_kv_heads * head_dim;   // elements per cache row (token)

  for (int j = threadIdx.x; j < G * head_dim; j += NUM_THREADS)
    q_s[j] = Cvt<D>::load(q[((long long)seq * num_q_heads + kvh * G) * head_dim + j]);
  for (int t = start + threadIdx.x; t < end; t += NUM_THREADS) {
    long long block = block_tables[(long long)seq * max_blocks + t / block_size];
    rows[t - start] = (block * block_size + t % block_size) * kv_stride + (long long)kvh * head_dim;
  }
  __syncthreads();

  // Scores: each warp takes a token at a time; lanes split the head dim; G dot products per token.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int t = start + warp; t < end; t += NUM_THREADS / 32) {
    const typename D::T* kp = k_cache + rows[t - start];
    float kv[8];                                // head_dim <= 256
#pragma unroll
    for (int e = 0; e < 8; ++e) kv[e] = (lane + 32 * e < head_dim) ? Cvt<D>::load(kp[lane + 32 * e]) : 0.f;
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      if (g < G) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (lane + 32 * e < head_dim) dot += q_s[g * head_dim + lane + 32 * e] * kv[e];
        dot = warp_sum(dot);
        if (lane == 0) scores[g * partition + (t - start)] = dot * scale;
      }
    }
  }
  __syncthreads();

  // Softmax over the partition, per query head.
  float m[MAX_G], l[MAX_G];
#pragma unroll
  for (int g = 0; g < MAX_G; ++g) {
    if (g < G) {
      float mx = NEG_INF;
      for (int i = threadIdx.x; i < end - start; i += NUM_THREADS) mx = fmaxf(mx, scores[g * partition + i]);
      m[g] = block_max(mx, red);
      float sum = 0.f;
      for (int i = threadIdx.x; i < end - start; i += NUM_THREADS) {
        float p = __expf(scores[g * partition + i] - m[g]);
        scores[g * partition + i] = p;
        sum += p;
      }
      l[g] = block_total(sum, red);
    }
  }
  __syncthreads();

  // Weighted sum of V: thread groups of head_dim threads split the tokens; each thread owns one dim.
  const int groups = NUM_THREADS >= head_dim ? NUM_THREADS / head_dim : 1;
  const int group = threadIdx.x / head_dim;     // 0 for every thread when head_dim > NUM_THREADS
  if (group < groups) {
    for (int d = threadIdx.x % head_dim; d < head_dim; d += NUM_THREADS) {
      float acc[MAX_G];
#pragma unroll
      for (int g = 0; g < MAX_G; ++g) acc[g] = 0.f;
      for (int t = start + group; t < end; t += groups) {
        float v = Cvt<D>::load(v_cache[rows[t - start] + d]);
#pragma unroll
        for (int g = 0; g < MAX_G; ++g)
          if (g < G) acc[g] += scores[g * partition + (t - start)] * v;
      }
#pragma unroll
      for (int g = 0; g < MAX_G; ++g)
        if (g < G) acc_s[(group * G + g) * head_dim + d] = acc[g];
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < G * head_dim; j += NUM_THREADS) {
    int g = j / head_dim, d = j % head_dim;
    float total = 0.f;
    for (int gr = 0; gr < groups; ++gr) total += acc_s[(gr * G + g) * head_dim + d];
    // m and l live in every thread's registers (block reductions), so any thread may normalise.
    float lg = 0.f, mg = 0.f;
#pragma unroll
    for (int gg = 0; gg < MAX_G; ++gg)
      if (gg == g) { lg = l[gg]; mg = m[gg]; }
    if (num_splits == 1) {
      out[((long long)seq * num_q_heads + kvh * G + g) * head_dim + d] = Cvt<D>::store(total / lg);
    } else {
      part_out[(part_row + g * num_splits) * head_dim + d] = total / lg;
      if (d == 0) {
        part_max[part_row + g * num_splits] = mg;
        part_sum[part_row + g * num_splits] = lg;
      }
    }
  }
}

// Combines the partitions of each (sequence, query head): grid (num_seqs, num_q_heads), head_dim threads.
template <typename D>
__device__ void reduce_partitions(const float* __restrict__ part_out, const float* __restrict__ part_max,
                                  const float* __restrict__ part_sum, typename D::T* __restrict__ out,
                                  int num_q_heads, int head_dim, int num_splits) {
  const long long row = (long long)blockIdx.x * num_q_heads + blockIdx.y;
  float mx = NEG_INF;
  for (int i = 0; i < num_splits; ++i) mx = fmaxf(mx, part_max[row * num_splits + i]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int i = 0; i < num_splits; ++i) {
      float l = part_sum[row * num_splits + i];
      if (l == 0.f) continue;                   // an empty partition: its output was never written
      float w = l * __expf(part_max[row * num_splits + i] - mx);
      num += w * part_out[(row * num_splits + i) * head_dim + d];
      den += w;
    }
    out[row * head_dim + d] = Cvt<D>::store(num / den);
  }
}

#define MII_DECODE(SUFFIX, D)                                                                                  \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_decode_##SUFFIX(                  \
      const D::T* q, const D::T* k_cache, const D::T* v_cache, const long long* block_tables,                \
      const long long* context_lens, D::T* out, float* part_out, float* part_max, float* part_sum,           \
      int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, int partition,        \
      float scale) {                                                                                           \
    decode_partition<D>(q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_max, part_sum,  \
                        num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, partition, scale);       \
  }                                                                                                            \
  extern "C" __global__ void paged_attention_reduce_##SUFFIX(const float* part_out, const float* part_max,    \
                                                             const float* part_sum, D::T* out,                \
                                                             int num_q_heads, int head_dim, int num_splits) { \
    reduce_partitions<D>(part_out, part_max, part_sum, out, num_q_heads, head_dim, num_splits);              \
  }
MII_FOR_DTYPES(MII_DECODE)
