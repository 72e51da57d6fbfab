// Paged attention for decode (one query token per sequence) over the blocked KV cache, split over the context
// (flash-decoding) so that few sequences with long contexts still fill the GPU.
//
// Grid (num_seqs, num_kv_heads, num_splits), NUM_THREADS threads. One block takes one KV head, the G = Hq/Hkv
// query heads that share it (GQA: each K/V row is read once for all G), and one partition of `partition`
// context tokens. Scores, softmax and the weighted sum of V are in fp32. With one split the block writes the
// output; otherwise it writes its partition's (max, sum, normalised output) and paged_attention_reduce
// combines them. Caches are [num_blocks, block_size, Hkv, D]; block_tables [num_seqs, max_blocks] int64.
//
//   QK:  a group of 4 lanes takes one token (8 tokens per warp at once); lane j of the group loads 16-byte
//        chunks j, j+4, … of the key row (coalesced 64 B per group), dots them with the G queries held in
//        shared memory, and the group sums over 2 shuffles.
//   softmax: warp w takes query heads w, w+4, … (warp reductions only).
//   PV:  a V row is read as 16-byte chunks by a few lanes, so that a warp loads several rows at once (and
//        PV_UNROLL times over) before the arithmetic, for up to 4 query heads at a time; partial sums meet by
//        shuffles within the warp, then across warps in shared memory.
#include "common.cuh"

#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / 32)
// Resident blocks per SM that the register budget must allow (occupancy), by the bound on G.
#define MIN_BLOCKS_4 8
#define MIN_BLOCKS_8 6
#define MIN_BLOCKS_16 4
#define LANES_PER_TOKEN 4
#define NEG_INF (-3.0e38f)
#define PV_UNROLL 2

// 16 bytes of a cache row as floats: 8 elements of a 16-bit type, 4 of float.
template <typename D> struct Chunk { static constexpr int N = 8; };
template <> struct Chunk<F32> { static constexpr int N = 4; };

template <typename D>
__device__ __forceinline__ void load_chunk(const typename D::T* p, float* out) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const unsigned short* h = reinterpret_cast<const unsigned short*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = Cvt<D>::load(h[i]);
}
template <>
__device__ __forceinline__ void load_chunk<F32>(const float* p, float* out) {
  float4 raw = *reinterpret_cast<const float4*>(p);
  out[0] = raw.x; out[1] = raw.y; out[2] = raw.z; out[3] = raw.w;
}

template <typename D, int MAX_G>
__device__ void decode_partition(const typename D::T* __restrict__ q, const typename D::T* __restrict__ k_cache,
                                 const typename D::T* __restrict__ v_cache, const long long* __restrict__ block_tables,
                                 const long long* __restrict__ context_lens, typename D::T* __restrict__ out,
                                 float* __restrict__ part_out, float* __restrict__ part_max,
                                 float* __restrict__ part_sum, int num_q_heads, int num_kv_heads, int head_dim,
                                 int block_size, int max_blocks, int partition, float scale) {
  constexpr int CN = Chunk<D>::N;
  const int seq = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
  const int G = num_q_heads / num_kv_heads;
  const int ctx = (int)context_lens[seq];
  const int start = split * partition;
  const int end = min(start + partition, ctx);
  const int n = end - start;
  const long long part_row = ((long long)seq * num_q_heads + kvh * G) * num_splits + split;  // head g adds g*num_splits
  if (n <= 0) {                                  // an empty partition of a shorter sequence
    if (threadIdx.x < G) {
      part_max[part_row + threadIdx.x * num_splits] = NEG_INF;
      part_sum[part_row + threadIdx.x * num_splits] = 0.f;
    }
    return;
  }
  extern __shared__ float smem[];
  float* q_s = smem;                             // [G, D] the queries, fp32
  float* scores = q_s + G * head_dim;            // [G, partition] scores, then probabilities
  float* stat = scores + G * partition;          // [2, G] max and sum per query head
  long long* rows = (long long*)(stat + 2 * MAX_G);   // [partition] element offset of each token's K/V row
  float* acc_s = (float*)(rows + partition);     // [NUM_WARPS, G, D] partial outputs
  const long long kv_stride = (long long)num_kv_heads * head_dim;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  for (int j = threadIdx.x; j < G * head_dim; j += NUM_THREADS)
    q_s[j] = Cvt<D>::load(q[((long long)seq * num_q_heads + kvh * G) * head_dim + j]);
  for (int i = threadIdx.x; i < n; i += NUM_THREADS) {
    int t = start + i;
    long long block = block_tables[(long long)seq * max_blocks + t / block_size];
    rows[i] = (block * block_size + t % block_size) * kv_stride + (long long)kvh * head_dim;
  }
  __syncthreads();

  // QK
  const int sub = lane % LANES_PER_TOKEN;        // this lane's place in its token group
  const int chunks = head_dim / CN;              // 16-byte chunks per row
  // Each group takes two tokens per pass (STRIDE apart), loading both rows before the arithmetic, so that
  // more loads are in flight.
  constexpr int TOKENS_PER_WARP = 32 / LANES_PER_TOKEN;
  constexpr int STRIDE = NUM_THREADS / LANES_PER_TOKEN;
  for (int base = warp * TOKENS_PER_WARP; base < n; base += 2 * STRIDE) {        // warp-uniform
    const int ia = base + lane / LANES_PER_TOKEN, ib = ia + STRIDE;
    const bool va = ia < n, vb = ib < n;
    const typename D::T* kpa = k_cache + (va ? rows[ia] : 0);
    const typename D::T* kpb = k_cache + (vb ? rows[ib] : 0);
    float da[MAX_G], db[MAX_G];
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) da[g] = db[g] = 0.f;
#pragma unroll 2
    for (int c = sub; c < chunks; c += LANES_PER_TOKEN) {
      float ka[CN], kb[CN];
      if (va) load_chunk<D>(kpa + c * CN, ka);
      else
#pragma unroll
        for (int e = 0; e < CN; ++e) ka[e] = 0.f;
      if (vb) load_chunk<D>(kpb + c * CN, kb);
      else
#pragma unroll
        for (int e = 0; e < CN; ++e) kb[e] = 0.f;
#pragma unroll
      for (int g = 0; g < MAX_G; ++g) {
        if (g < G) {
          const float* qg = q_s + g * head_dim + c * CN;
#pragma unroll
          for (int e = 0; e < CN; ++e) {
            da[g] += qg[e] * ka[e];
            db[g] += qg[e] * kb[e];
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      if (g < G) {                               // G is block-uniform: every lane shuffles
        float x = da[g], y = db[g];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        y += __shfl_xor_sync(0xffffffffu, y, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        y += __shfl_xor_sync(0xffffffffu, y, 2);
        if (sub == 0) {
          if (va) scores[g * partition + ia] = x * scale;
          if (vb) scores[g * partition + ib] = y * scale;
        }
      }
    }
  }
  __syncthreads();

  // softmax per query head, one warp per head
  for (int g = warp; g < G; g += NUM_WARPS) {
    float* sg = scores + g * partition;
    float mx = NEG_INF;
    for (int i = lane; i < n; i += 32) mx = fmaxf(mx, sg[i]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int i = lane; i < n; i += 32) {
      float p = __expf(sg[i] - mx);
      sg[i] = p;
      sum += p;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      stat[g] = mx;
      stat[MAX_G + g] = sum;
    }
  }
  __syncthreads();

  // PV: a row of V is `lanes` lanes' 16-byte chunks (a power of two ≤ 32 dividing the row's chunks; a lane
  // takes `chunks / lanes` of them, one pass each), so a warp reads 32 / lanes rows at once, PV_UNROLL times
  // over before it multiplies: up to 16 rows in flight per warp. The rows' partial sums meet by shuffles,
  // then the warps' in shared memory.
  {
    int lanes = 32;
    while (lanes > 1 && chunks % lanes != 0) lanes >>= 1;
    if (lanes > chunks) lanes = chunks;
    const int rows_per_warp = 32 / lanes, slot = lane / lanes;
    const int row_step = NUM_WARPS * rows_per_warp;
    for (int cp = 0; cp < chunks / lanes; ++cp) {
      const int dim0 = ((lane % lanes) + cp * lanes) * CN;
      for (int g0 = 0; g0 < G; g0 += 4) {
        float acc[4][CN];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
          for (int e = 0; e < CN; ++e) acc[a][e] = 0.f;
        for (int base = warp * rows_per_warp + slot; base < n; base += PV_UNROLL * row_step) {
          float vf[PV_UNROLL][CN];
#pragma unroll
          for (int u = 0; u < PV_UNROLL; ++u) {
            const int i = base + u * row_step;
            if (i < n) load_chunk<D>(v_cache + rows[i] + dim0, vf[u]);
            else
#pragma unroll
              for (int e = 0; e < CN; ++e) vf[u][e] = 0.f;
          }
#pragma unroll
          for (int u = 0; u < PV_UNROLL; ++u) {
            const int i = base + u * row_step;
            if (i < n) {
#pragma unroll
              for (int a = 0; a < 4; ++a) {
                if (g0 + a < G) {
                  const float p = scores[(g0 + a) * partition + i];
#pragma unroll
                  for (int e = 0; e < CN; ++e) acc[a][e] += p * vf[u][e];
                }
              }
            }
          }
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
          for (int e = 0; e < CN; ++e)
            for (int off = lanes; off < 32; off <<= 1) acc[a][e] += __shfl_xor_sync(0xffffffffu, acc[a][e], off);
        if (slot == 0) {
#pragma unroll
          for (int a = 0; a < 4; ++a)
            if (g0 + a < G)
#pragma unroll
              for (int e = 0; e < CN; ++e) acc_s[(warp * G + g0 + a) * head_dim + dim0 + e] = acc[a][e];
        }
      }
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < G * head_dim; j += NUM_THREADS) {
    int g = j / head_dim, d = j % head_dim;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) total += acc_s[(w * G + g) * head_dim + d];
    float l = stat[MAX_G + g];
    if (num_splits == 1) {
      out[((long long)seq * num_q_heads + kvh * G + g) * head_dim + d] = Cvt<D>::store(total / l);
    } else {
      part_out[(part_row + g * num_splits) * head_dim + d] = total / l;
      if (d == 0) {
        part_max[part_row + g * num_splits] = stat[g];
        part_sum[part_row + g * num_splits] = l;
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

// One decode kernel per bound on G = Hq / Hkv (4, 8, 16): the per-head score registers are sized by it, so
// that the common G ≤ 4 keeps enough blocks resident per SM.
#define MII_DECODE_G(SUFFIX, D, G)                                                                             \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS_##G) paged_attention_decode_g##G##_##SUFFIX( \
      const D::T* q, const D::T* k_cache, const D::T* v_cache, const long long* block_tables,                \
      const long long* context_lens, D::T* out, float* part_out, float* part_max, float* part_sum,           \
      int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, int partition,        \
      float scale) {                                                                                           \
    decode_partition<D, G>(q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_max,         \
                           part_sum, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, partition,  \
                           scale);                                                                             \
  }
#define MII_DECODE(SUFFIX, D)                                                                                  \
  MII_DECODE_G(SUFFIX, D, 4)                                                                                   \
  MII_DECODE_G(SUFFIX, D, 8)                                                                                   \
  MII_DECODE_G(SUFFIX, D, 16)                                                                                  \
  extern "C" __global__ void paged_attention_reduce_##SUFFIX(const float* part_out, const float* part_max,    \
                                                             const float* part_sum, D::T* out,                \
                                                             int num_q_heads, int head_dim, int num_splits) { \
    reduce_partitions<D>(part_out, part_max, part_sum, out, num_q_heads, head_dim, num_splits);              \
  }
MII_FOR_DTYPES(MII_DECODE)
