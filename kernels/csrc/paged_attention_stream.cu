// Paged attention for decode, streamed: the same contract as paged_attention_decode.cu (grid (num_kv_heads,
// num_seqs, num_splits), the same split outputs and combine), for head dim 128 and up to 4 query heads
// per KV head, in 16-bit types. Where that kernel reads a partition twice in two phases (QK, then PV) with a
// block-wide softmax between them, this one reads each K and V row once, in one pass:
//
//   - Each warp streams its own rows: per round a warp takes WROWS tokens (a row is 16 lanes' 16-byte
//     chunks, so a warp reads 2 rows at once, twice), and its next STAGES - 1 rounds are in flight as
//     cp.async copies into the warp's own shared-memory ring. No block barrier until the end: a warp waits
//     only for its own copies.
//   - Each group of 16 lanes keeps an online softmax (running max, sum and output, fp32) for the G heads,
//     over the rows it took; the queries (pre-scaled by scale * log2 e, so that exp2 serves) and the output
//     slice of each lane stay in registers.
//   - At the end the 8 groups' states meet in shared memory, and the block writes the output (one split)
//     or its partition for the last split to combine (decode_combine.cuh).
//   - A sliding `window` (> 0) starts a sequence's partitions at max(0, context - window); a `softcap` (> 0)
//     turns each score s·scale into softcap·tanh(s·scale / softcap), here in log2 units: the dot products
//     carry scale · log2 e already.
#include "common.cuh"
#include "cp_async.cuh"
#include "decode_combine.cuh"

#ifndef NUM_THREADS
#define NUM_THREADS 128
#endif
#define NUM_WARPS (NUM_THREADS / 32)
#ifndef STAGES                    // rounds of copies per warp, STAGES - 1 in flight while one is used
#define STAGES 4
#endif
#ifndef MIN_BLOCKS                // resident blocks per SM the register budget must allow
#define MIN_BLOCKS 4
#endif
#define HD 128                    // head dim
#define MAX_G 4                   // query heads per KV head
#define LPR (HD / 8)              // lanes per row: one 16-byte chunk each
#define RW (32 / LPR)             // rows a warp reads at once
#ifndef RPS                       // rows per lane group per round
#define RPS 2
#endif
#define WROWS (RW * RPS)          // rows per warp per round
#define ROUND (NUM_WARPS * WROWS) // tokens per round of the block
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

template <typename D>
__device__ __forceinline__ void unpack8(const uint4& raw, float* out) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = Cvt<D>::load((typename D::T)(w[i] & 0xffffu));
    out[2 * i + 1] = Cvt<D>::load((typename D::T)(w[i] >> 16));
  }
}

template <typename D>
__device__ void stream_partition(const typename D::T* __restrict__ q, const typename D::T* __restrict__ k_cache,
                                 const typename D::T* __restrict__ v_cache, const long long* __restrict__ block_tables,
                                 const long long* __restrict__ context_lens, typename D::T* __restrict__ out,
                                 float* __restrict__ part_out, float* __restrict__ part_max,
                                 float* __restrict__ part_sum, int* __restrict__ counters, int num_q_heads,
                                 int num_kv_heads, int block_size, int max_blocks, int partition,
                                 int min_partition, float scale, int window, float softcap) {
  typedef typename D::T T;
  const int seq = grid_seq(), kvh = grid_kvh(), split = blockIdx.z, num_splits = gridDim.z;
  const int G = num_q_heads / num_kv_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grp = lane / LPR, sub = lane % LPR;  // the row of the warp's RW this lane reads; its chunk
  // the window's first token and the split's length (step inputs: read before the previous kernel is waited for)
  const int ctx = (int)context_lens[seq], first = window > 0 ? max(0, ctx - window) : 0;
  const int part = split_length(ctx - first, partition, min_partition);
  const int start = first + split * part;
  const long long part_row = ((long long)seq * num_q_heads + kvh * G) * num_splits + split;
  // Shared memory: the warps' rings [NUM_WARPS][STAGES][WROWS][K, V][HD], then the partition's block ids.
  // After the stream the rings hold the groups' states instead.
  extern __shared__ uint4 smem_u4[];
  T* ring = reinterpret_cast<T*>(smem_u4) + warp * (STAGES * WROWS * 2 * HD);
  long long* blocks = reinterpret_cast<long long*>(reinterpret_cast<T*>(smem_u4) + NUM_WARPS * STAGES * WROWS * 2 * HD);
  pdl_launch_dependents();

  const int b0 = start / block_size;
  const int n = partition_start<D, NUM_THREADS>(block_tables, context_lens, blocks, start, part, block_size,
                                                max_blocks, part_row, G, num_q_heads, HD, part_out, part_max,
                                                part_sum, out, counters);
  if (n == 0) return;                            // an empty partition of a shorter sequence

  const long long kv_stride = (long long)num_kv_heads * HD;
  const int rounds = (n + ROUND - 1) / ROUND;
  // Issues round r's copies into its ring slot: this lane's chunk of the K and V rows it reads.
  auto issue = [&](int r) {
    T* slot = ring + (r % STAGES) * (WROWS * 2 * HD);
#pragma unroll
    for (int j = 0; j < RPS; ++j) {
      const int i = r * ROUND + warp * WROWS + j * RW + grp;   // token within the partition
      const bool valid = i < n;
      const int t = start + (valid ? i : 0);
      const long long row = (blocks[t / block_size - b0] * block_size + t % block_size) * kv_stride + (long long)kvh * HD;
      T* dst = slot + (j * RW + grp) * 2 * HD + sub * 8;
      cp_async16(smem_u32(dst), k_cache + row + sub * 8, valid ? 16 : 0);
      cp_async16(smem_u32(dst + HD), v_cache + row + sub * 8, valid ? 16 : 0);
    }
  };
#pragma unroll
  for (int r = 0; r < STAGES - 1; ++r) {
    if (r < rounds) issue(r);
    cp_async_commit();                           // (empty groups keep the count uniform)
  }

  float qr[MAX_G][8];
  const float qscale = scale * LOG2E;
#pragma unroll
  for (int g = 0; g < MAX_G; ++g) {
    if (g < G) {
      uint4 raw = *reinterpret_cast<const uint4*>(q + ((long long)seq * num_q_heads + kvh * G + g) * HD + sub * 8);
      unpack8<D>(raw, qr[g]);
#pragma unroll
      for (int e = 0; e < 8; ++e) qr[g][e] *= qscale;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qr[g][e] = 0.f;
    }
  }
  float m[MAX_G], l[MAX_G], acc[MAX_G][8];      // log2 units for m
#pragma unroll
  for (int g = 0; g < MAX_G; ++g) {
    m[g] = NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }
  const float minus_inf = __int_as_float(0xff800000);

  for (int r = 0; r < rounds; ++r) {
    if (r + STAGES - 1 < rounds) issue(r + STAGES - 1);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();                 // this lane's copies of round r have landed
    __syncwarp();                                // and every lane's of the warp
    const T* slot = ring + (r % STAGES) * (WROWS * 2 * HD);
    float s[RPS][MAX_G];
    float v[RPS][8];
#pragma unroll
    for (int j = 0; j < RPS; ++j) {
      const T* rowp = slot + (j * RW + grp) * 2 * HD + sub * 8;
      float k[8];
      unpack8<D>(*reinterpret_cast<const uint4*>(rowp), k);
      unpack8<D>(*reinterpret_cast<const uint4*>(rowp + HD), v[j]);
#pragma unroll
      for (int g = 0; g < MAX_G; ++g) {
        float x = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) x += qr[g][e] * k[e];
        s[j][g] = x;
      }
    }
#pragma unroll
    for (int j = 0; j < RPS; ++j)
#pragma unroll
      for (int g = 0; g < MAX_G; ++g)
#pragma unroll
        for (int off = 1; off < LPR; off <<= 1) s[j][g] += __shfl_xor_sync(0xffffffffu, s[j][g], off);
    if (softcap > 0.f) {                         // block-uniform
      const float cap_l2 = softcap * LOG2E, inv_cap_l2 = 1.f / cap_l2;
#pragma unroll
      for (int j = 0; j < RPS; ++j)
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) s[j][g] = cap_l2 * tanhf(s[j][g] * inv_cap_l2);
    }
#pragma unroll
    for (int j = 0; j < RPS; ++j) {
      const int i = r * ROUND + warp * WROWS + j * RW + grp;
      if (i >= n)
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) s[j][g] = minus_inf;
    }
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      float mx = m[g];
#pragma unroll
      for (int j = 0; j < RPS; ++j) mx = fmaxf(mx, s[j][g]);
      const float alpha = exp2f(m[g] - mx);
      m[g] = mx;
      float p[RPS];
      float ps = 0.f;
#pragma unroll
      for (int j = 0; j < RPS; ++j) {
        p[j] = exp2f(s[j][g] - mx);
        ps += p[j];
      }
      l[g] = l[g] * alpha + ps;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float a = acc[g][e] * alpha;
#pragma unroll
        for (int j = 0; j < RPS; ++j) a += p[j] * v[j][e];
        acc[g][e] = a;
      }
    }
    __syncwarp();                                // the slot is read before a later round's copies refill it
  }
  cp_async_wait<0>();
  __syncthreads();                               // the rings are free: they take the groups' states

  // States: acc [NUM_WARPS * RW][G][HD], then m and l [NUM_WARPS * RW][G] (natural-log units for m).
  float* st_acc = reinterpret_cast<float*>(smem_u4);
  float* st_m = st_acc + NUM_WARPS * RW * MAX_G * HD;
  float* st_l = st_m + NUM_WARPS * RW * MAX_G;
  const int state = warp * RW + grp;
#pragma unroll
  for (int g = 0; g < MAX_G; ++g) {
    if (g < G) {
      float* dst = st_acc + (state * MAX_G + g) * HD + sub * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = acc[g][e];
      if (sub == 0) {
        st_m[state * MAX_G + g] = m[g] * LN2;
        st_l[state * MAX_G + g] = l[g];
      }
    }
  }
  __syncthreads();
  merge_states<D, NUM_WARPS * RW, MAX_G, HD, NUM_THREADS>(st_m, st_l, st_acc, G, (long long)seq * num_q_heads + kvh * G,
                                                        out, part_row, num_splits, part_out, part_max, part_sum);
  if (num_splits > 1) combine_if_last<D>(part_out, part_max, part_sum, out, counters, num_q_heads, HD, G);
}

#define MII_STREAM(SUFFIX, D)                                                                                  \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS) paged_attention_stream_##SUFFIX(     \
      const D::T* q, const D::T* k_cache, const D::T* v_cache, const long long* block_tables,                \
      const long long* context_lens, D::T* out, float* part_out, float* part_max, float* part_sum,           \
      int* counters, int num_q_heads, int num_kv_heads, int block_size, int max_blocks, int partition,       \
      int min_partition, float scale, int window, float softcap) {                                             \
    stream_partition<D>(q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_max, part_sum,  \
                        counters, num_q_heads, num_kv_heads, block_size, max_blocks, partition, min_partition, \
                        scale, window, softcap);                                                               \
  }
MII_STREAM(bf16, BF16)
MII_STREAM(f16, F16)

// Shared memory a launch takes (kernels/cuda.py computes it): the rings, NUM_WARPS * STAGES * WROWS * 2 * HD
// 16-bit values (32 KiB at STAGES 4), which later hold the states (NUM_WARPS * RW * MAX_G * (HD + 2) floats,
// 16.25 KiB), then 8 bytes per block id of a partition.
