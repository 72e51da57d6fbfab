// Paged attention for decode (one query token per sequence) over the blocked KV cache, split over the context
// (flash-decoding) so that few sequences with long contexts still fill the GPU.
//
// Grid (num_kv_heads, num_seqs, num_splits), NUM_THREADS threads. One block takes one KV head, the G = Hq/Hkv
// query heads that share it (GQA: each K/V row is read once for all G), and one partition of `partition`
// context tokens. Scores, softmax and the weighted sum of V are in fp32. With one split the block writes the
// output; otherwise it writes its partition's (max, sum, normalised output), and the last of the splits to
// finish combines them (`combine_if_last`; `counters` [num_seqs * Hkv] int32, zero between launches). Caches
// are [num_blocks, block_size, Hkv, D]; block_tables [num_seqs, max_blocks] int64.
//
// With a sliding `window` (> 0) a sequence attends to its last `window` tokens: its partitions start at
// max(0, context - window), so the grid's splits cover min(max context, window) tokens and no block before the
// window is read. With `softcap` (> 0) each score s·scale becomes softcap·tanh(s·scale / softcap) (Gemma 2).
//
//   QK:  a group of 4 lanes takes one token (8 tokens per warp at once); lane j of the group loads 16-byte
//        chunks j, j+4, … of the key row (coalesced 64 B per group), dots them with the G queries held in
//        shared memory, and the group sums over 2 shuffles.
//   softmax: warp w takes query heads w, w+4, … (warp reductions only).
//   PV:  a V row is read as 16-byte chunks by a few lanes, so that a warp loads several rows at once (and
//        PV_UNROLL times over, the next ones in flight while these are multiplied; the first before QK), for up
//        to 4 query heads at a time; partial sums meet by shuffles within the warp, then across warps in shared
//        memory.
//
// Compiled with MII_KV_FP8 the caches are e4m3 (kv_cache_dtype="fp8"): a lane loads 8 bytes (8 elements) where
// it loads 16 of a 16-bit cache, so that the loops keep their shapes; the widened elements are 2^-8 times their
// values (fp8.cuh), a factor folded into the score scale for K and into the final normalisation for V.
#include "common.cuh"
#include "decode_combine.cuh"
#include "fp8.cuh"

#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / 32)
// Resident blocks per SM that the register budget must allow (occupancy), by the bound on G.
#ifndef MIN_BLOCKS_4              // (-D overrides them, for tuning)
#define MIN_BLOCKS_4 6
#endif
#ifndef MIN_BLOCKS_8
#define MIN_BLOCKS_8 6
#endif
#ifndef MIN_BLOCKS_16
#define MIN_BLOCKS_16 4
#endif
#define LANES_PER_TOKEN 4
#ifndef PV_UNROLL
#define PV_UNROLL 2
#endif
#ifndef QK_UNROLL                 // key chunks per lane and token loaded before their dot products
#define QK_UNROLL 2
#endif
constexpr int kQkUnroll = QK_UNROLL;   // (#pragma unroll takes a constant, not a macro)

// A chunk of a cache row as a lane loads it: 16 bytes (8 elements of a 16-bit type, 4 of float), or 8 bytes
// (8 e4m3 elements). Loads keep them packed until the arithmetic, so that more rows can be in flight. `unit`:
// what the unpacked elements are multiplied by to be the cache's values.
template <typename C> struct Chunk { static constexpr int N = 8; typedef uint4 Raw; static constexpr float unit = 1.f; };
template <> struct Chunk<F32> { static constexpr int N = 4; typedef uint4 Raw; static constexpr float unit = 1.f; };
template <> struct Chunk<E4M3> { static constexpr int N = 8; typedef uint2 Raw; static constexpr float unit = E4M3_UNIT; };

__device__ __forceinline__ void zero_chunk(uint4& z) { z.x = z.y = z.z = z.w = 0u; }
__device__ __forceinline__ void zero_chunk(uint2& z) { z.x = z.y = 0u; }
template <typename C>
__device__ __forceinline__ void unpack(const typename Chunk<C>::Raw& raw, float* out) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = Cvt<C>::load((typename C::T)(w[i] & 0xffffu));
    out[2 * i + 1] = Cvt<C>::load((typename C::T)(w[i] >> 16));
  }
}
template <>
__device__ __forceinline__ void unpack<F32>(const uint4& raw, float* out) {
  out[0] = __uint_as_float(raw.x); out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z); out[3] = __uint_as_float(raw.w);
}
template <>
__device__ __forceinline__ void unpack<E4M3>(const uint2& raw, float* out) {
  widen4(raw.x, out[0], out[1], out[2], out[3]);
  widen4(raw.y, out[4], out[5], out[6], out[7]);
}
template <typename C>
__device__ __forceinline__ void load_chunk(const typename C::T* p, float* out) {
  unpack<C>(*reinterpret_cast<const typename Chunk<C>::Raw*>(p), out);
}
// PV_UNROLL V chunks at `dim0` of rows base, base + step, … (zeros past n).
template <typename C>
__device__ __forceinline__ void load_v(typename Chunk<C>::Raw (&r)[PV_UNROLL], const typename C::T* __restrict__ v_cache,
                                       const long long* rows, int base, int step, int n, int dim0) {
#pragma unroll
  for (int u = 0; u < PV_UNROLL; ++u) {
    const int i = base + u * step;
    if (i < n) r[u] = *reinterpret_cast<const typename Chunk<C>::Raw*>(v_cache + rows[i] + dim0);
    else zero_chunk(r[u]);
  }
}

// A score after its scale, soft-capped where `cap` > 0.
__device__ __forceinline__ float soft_cap(float x, float cap) { return cap > 0.f ? cap * tanhf(x / cap) : x; }

template <typename D, typename C, int MAX_G>
__device__ void decode_partition(const typename D::T* __restrict__ q, const typename C::T* __restrict__ k_cache,
                                 const typename C::T* __restrict__ v_cache, const long long* __restrict__ block_tables,
                                 const long long* __restrict__ context_lens, typename D::T* __restrict__ out,
                                 float* __restrict__ part_out, float* __restrict__ part_max,
                                 float* __restrict__ part_sum, int* __restrict__ counters, int num_q_heads,
                                 int num_kv_heads, int head_dim, int block_size, int max_blocks, int partition,
                                 int min_partition, float scale, int window, float softcap) {
  constexpr int CN = Chunk<C>::N;
  typedef typename Chunk<C>::Raw Raw;
  const float kscale = scale * Chunk<C>::unit;
  const int seq = grid_seq(), kvh = grid_kvh(), split = blockIdx.z, num_splits = gridDim.z;
  const int G = num_q_heads / num_kv_heads;
  const int ctx = (int)context_lens[seq], first = window > 0 ? max(0, ctx - window) : 0;
  const int part = split_length(ctx - first, partition, min_partition);   // ≤ partition, the layout's stride
  const int start = first + split * part;
  const long long part_row = ((long long)seq * num_q_heads + kvh * G) * num_splits + split;  // head g adds g*num_splits
  extern __shared__ float smem[];
  float* q_s = smem;                             // [G, D] the queries, fp32
  float* scores = q_s + G * head_dim;            // [G, partition] scores, then probabilities
  float* stat = scores + G * partition;          // [2, G] max and sum per query head
  long long* rows = (long long*)(stat + 2 * MAX_G);   // [partition] element offset of each token's K/V row
  float* acc_s = (float*)(rows + partition);     // [NUM_WARPS, G, D] partial outputs
  const long long kv_stride = (long long)num_kv_heads * head_dim;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  pdl_launch_dependents();

  // The rows of the whole partition (as far as the table reaches) are read while the context length is still
  // in flight: a padded table entry is a valid block, and rows past the context are not read. Both are the
  // step's inputs, so they are read before the previous kernel is waited for; the queries after.
  const int table_end = min(start + part, max_blocks * block_size);
  for (int i = threadIdx.x; start + i < table_end; i += NUM_THREADS) {
    int t = start + i;
    long long block = block_tables[(long long)seq * max_blocks + t / block_size];
    rows[i] = (block * block_size + t % block_size) * kv_stride + (long long)kvh * head_dim;
  }
  pdl_wait();
  for (int j = threadIdx.x; j < G * head_dim; j += NUM_THREADS)
    q_s[j] = Cvt<D>::load(q[((long long)seq * num_q_heads + kvh * G) * head_dim + j]);
  const int n = min(start + part, ctx) - start;
  if (n > 0) {                                   // else an empty partition of a shorter sequence
    __syncthreads();
    const int chunks = head_dim / CN;              // chunks per row
    // PV's layout (below), and its first V chunks, loaded now so that they arrive during QK and the softmax.
    int lanes = 32;
    while (lanes > 1 && chunks % lanes != 0) lanes >>= 1;
    if (lanes > chunks) lanes = chunks;
    const int rows_per_warp = 32 / lanes, slot = lane / lanes;
    const int row_step = NUM_WARPS * rows_per_warp, first = warp * rows_per_warp + slot;
    Raw pre[PV_UNROLL];
    load_v<C>(pre, v_cache, rows, first, row_step, n, (lane % lanes) * CN);

    // QK
    const int sub = lane % LANES_PER_TOKEN;        // this lane's place in its token group
    // Each group takes two tokens per pass (STRIDE apart), loading both rows before the arithmetic, so that
    // more loads are in flight.
    constexpr int TOKENS_PER_WARP = 32 / LANES_PER_TOKEN;
    constexpr int STRIDE = NUM_THREADS / LANES_PER_TOKEN;
    for (int base = warp * TOKENS_PER_WARP; base < n; base += 2 * STRIDE) {        // warp-uniform
      const int ia = base + lane / LANES_PER_TOKEN, ib = ia + STRIDE;
      const bool va = ia < n, vb = ib < n;
      const typename C::T* kpa = k_cache + (va ? rows[ia] : 0);
      const typename C::T* kpb = k_cache + (vb ? rows[ib] : 0);
      float da[MAX_G], db[MAX_G];
#pragma unroll
      for (int g = 0; g < MAX_G; ++g) da[g] = db[g] = 0.f;
#pragma unroll kQkUnroll
      for (int c = sub; c < chunks; c += LANES_PER_TOKEN) {
        float ka[CN], kb[CN];
        if (va) load_chunk<C>(kpa + c * CN, ka);
        else
#pragma unroll
          for (int e = 0; e < CN; ++e) ka[e] = 0.f;
        if (vb) load_chunk<C>(kpb + c * CN, kb);
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
            if (va) scores[g * partition + ia] = soft_cap(x * kscale, softcap);
            if (vb) scores[g * partition + ib] = soft_cap(y * kscale, softcap);
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
    // over, and the next PV_UNROLL rows are loaded while these are multiplied (software pipelined). The rows'
    // partial sums meet by shuffles, then the warps' in shared memory.
    {
      for (int cp = 0; cp < chunks / lanes; ++cp) {
        const int dim0 = ((lane % lanes) + cp * lanes) * CN;
        for (int g0 = 0; g0 < G; g0 += 4) {
          float acc[4][CN];
#pragma unroll
          for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int e = 0; e < CN; ++e) acc[a][e] = 0.f;
          Raw cur[PV_UNROLL];
          if (cp == 0 && g0 == 0) {
#pragma unroll
            for (int u = 0; u < PV_UNROLL; ++u) cur[u] = pre[u];
          } else {
            load_v<C>(cur, v_cache, rows, first, row_step, n, dim0);
          }
          for (int base = first; base < n; base += PV_UNROLL * row_step) {
            Raw nxt[PV_UNROLL];
            load_v<C>(nxt, v_cache, rows, base + PV_UNROLL * row_step, row_step, n, dim0);
#pragma unroll
            for (int u = 0; u < PV_UNROLL; ++u) {
              const int i = base + u * row_step;
              if (i < n) {
                float vf[CN];
                unpack<C>(cur[u], vf);
#pragma unroll
                for (int a = 0; a < 4; ++a) {
                  if (g0 + a < G) {
                    const float p = scores[(g0 + a) * partition + i];
#pragma unroll
                    for (int e = 0; e < CN; ++e) acc[a][e] += p * vf[e];
                  }
                }
              }
              cur[u] = nxt[u];
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
      const float l = stat[MAX_G + g] / Chunk<C>::unit;   // V's widening factor undone with the sum
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
  } else if (threadIdx.x < G) {
    part_max[part_row + threadIdx.x * num_splits] = NEG_INF;
    part_sum[part_row + threadIdx.x * num_splits] = 0.f;
  }
  if (num_splits > 1) combine_if_last<D>(part_out, part_max, part_sum, out, counters, num_q_heads, head_dim, G);
}

// One decode kernel per bound on G = Hq / Hkv (4, 8, 16): the per-head score registers are sized by it, so
// that the common G ≤ 4 keeps enough blocks resident per SM.
#ifdef MII_KV_FP8
#define KV(D) E4M3
#else
#define KV(D) D
#endif
#define MII_DECODE_G(SUFFIX, D, G)                                                                             \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS_##G) paged_attention_decode_g##G##_##SUFFIX( \
      const D::T* q, const KV(D)::T* k_cache, const KV(D)::T* v_cache, const long long* block_tables,        \
      const long long* context_lens, D::T* out, float* part_out, float* part_max, float* part_sum,           \
      int* counters, int num_q_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,        \
      int partition, int min_partition, float scale, int window, float softcap) {                              \
    decode_partition<D, KV(D), G>(q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_max,         \
                           part_sum, counters, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks,   \
                           partition, min_partition, scale, window, softcap);                                  \
  }
#define MII_DECODE(SUFFIX, D)                                                                                  \
  MII_DECODE_G(SUFFIX, D, 4)                                                                                   \
  MII_DECODE_G(SUFFIX, D, 8)                                                                                   \
  MII_DECODE_G(SUFFIX, D, 16)
MII_FOR_DTYPES(MII_DECODE)
