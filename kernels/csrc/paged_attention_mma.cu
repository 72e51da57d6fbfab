// Paged attention for decode on tensor cores: the contract of paged_attention_decode.cu (grid (num_kv_heads,
// num_seqs, num_splits), the same split outputs and combine, decode_combine.cuh), for head dim 128 and up
// to 16 query heads per KV head, in 16-bit types (sm_80 on).
//
// A KV head's G query heads are the 16 rows of an mma tile (rows past G are zeros), so that the products run
// as m16n8k16 mma, as in a prefill kernel:
//   S^T [16 heads x 16 tokens] = Q [16 x 128] . K^T    16 mma per tile of 16 tokens, Q held in registers;
//   O   [16 heads x 128]      += P [16 x 16] . V        16 mma, P taken from S's accumulators in registers.
// By a count of their sources, the scalar kernels issue ~370 warp instructions per 2 KiB of K and V (dot
// products, shuffle reductions), close to issue bound at the clocks of the GEMMs' power cap; here a tile of
// 8 KiB costs ~200.
//
//   - Each warp streams its own tiles of 16 tokens (tiles warp, warp + kWarps, ...): its next
//     STAGES - 1 tiles are in flight as cp.async copies into its own shared-memory ring, rows swizzled
//     (16-byte chunk c of token t at c ^ (t & 7)) so that ldmatrix reads them without bank conflicts. No
//     block barrier until the end.
//   - Online softmax per head row in exp2 units (the scale folded with log2 e); a row's 16 scores of a tile
//     live in the 4 lanes of a quad, which reduce by two shuffles.
//   - At the end the warps' states meet in shared memory, and the block writes the output (one split) or its
//     partition for the last split to combine.
//   - A sliding `window` (> 0) starts a sequence's partitions at max(0, context - window); a `softcap` (> 0)
//     turns each score s·scale into softcap·tanh(s·scale / softcap) before the softmax.
//
// Compiled with MII_KV_FP8 the caches are e4m3 (kv_cache_dtype="fp8") and both products run as fp16 mma on
// widened elements (2^-8 times their values, fp8.cuh; the factor rides on the score scale and the final
// output). K needs no staging: ldmatrix of the e4m3 rows gives a lane 4 consecutive dims of a token, which widen
// to the B fragment of a permuted order of the 16 dims, and Q's fragments, built once, take the same order (a
// dot product does not depend on it). V's fragments are along the tokens, which bytes cannot be transposed into
// by ldmatrix: each tile of V is widened into a per-warp fp16 copy first, read as the 16-bit path reads its own.
#include "common.cuh"
#include "cp_async.cuh"
#include "decode_combine.cuh"
#include "fp8.cuh"

// Two widths, each a kernel of its own (kernels/decode_attention.py picks one per launch): 4 warps a block, 3
// blocks an SM (the shared memory of their rings bounds it), and 2 warps, 6 blocks an SM. The narrow blocks
// end and start more often per SM, so that one block's start (block ids, then its first tiles) and end (the
// warps' merge, the split combine) overlap the others' streaming. In a probe on the H200 they were ~10% faster
// for batches of 128+ sequences and slower for smaller ones, which have too few blocks to fill 6 an SM.
#ifndef STAGES                    // tiles in a warp's ring, STAGES - 1 in flight while one is used
#define STAGES 2
#endif
#define HD 128                    // head dim
#define MAX_G 16                  // query heads per KV head: an mma tile's rows
#define TILE 16                   // tokens per tile
#ifdef MII_KV_FP8
#define KV(D) E4M3
#define KV_BYTES 1                                 // bytes per cache element
#define KV_UNIT E4M3_UNIT                          // a widened element times this is its value
#define VSTAGE_BYTES (TILE * HD * 2)               // a warp's tile of V widened to fp16
#else
#define KV(D) D
#define KV_BYTES 2
#define KV_UNIT 1.f
#define VSTAGE_BYTES 0
#endif
#define ROW_BYTES (HD * KV_BYTES)                  // a token's K (or V) row of one head
#define ROW_CHUNKS (ROW_BYTES / 16)                // its 16-byte chunks
#define TILE_BYTES (TILE * ROW_BYTES)              // a tile of K (or V) rows
#define STAGE_BYTES (2 * TILE_BYTES)               // K then V
#define WARP_BYTES (STAGES * STAGE_BYTES + VSTAGE_BYTES)   // a warp's ring (and its V copy)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// c += a . b for one m16n8k16 tile, fp32 accumulators; and two floats packed as the type's pair (lo first).
template <typename D> struct Mma;
template <> struct Mma<BF16> {
  __device__ __forceinline__ static void run(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};
template <> struct Mma<F16> {
  __device__ __forceinline__ static void run(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

#ifdef MII_KV_FP8
// Four e4m3 bytes (dims 0..3 of w) → two fp16 pairs in order: dims (0, 1) in lo, (2, 3) in hi.
__device__ __forceinline__ void widen_in_order(unsigned w, unsigned& lo, unsigned& hi) {
  const unsigned p = __byte_perm(w, 0u, 0x3120);   // bytes 0, 2, 1, 3: the pairs widen_pair_* take
  lo = widen_pair_lo(p);
  hi = widen_pair_hi(p);
}
#endif

// D: the queries' and output's type; C: the cache's; M: the mma's operands (fp16 over an e4m3 cache).
template <typename D, typename C, typename M, int kWarps>
__device__ void mma_partition(const typename D::T* __restrict__ q, const typename C::T* __restrict__ k_cache,
                              const typename C::T* __restrict__ v_cache, const long long* __restrict__ block_tables,
                              const long long* __restrict__ context_lens, typename D::T* __restrict__ out,
                              float* __restrict__ part_out, float* __restrict__ part_max, float* __restrict__ part_sum,
                              int* __restrict__ counters, int num_q_heads, int num_kv_heads, int block_size,
                              int max_blocks, int partition, int min_partition, float scale, int window,
                              float softcap) {
  typedef typename D::T T;
  const int seq = grid_seq(), kvh = grid_kvh(), split = blockIdx.z, num_splits = gridDim.z;
  const int G = num_q_heads / num_kv_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int quad_row = lane >> 2, quad_col = lane & 3;   // an mma fragment's row (head) and column pair
  // the window's first token and the split's length (step inputs: read before the previous kernel is waited for)
  const int ctx = (int)context_lens[seq], first = window > 0 ? max(0, ctx - window) : 0;
  const int part = split_length(ctx - first, partition, min_partition);
  const int start = first + split * part;
  const long long part_row = ((long long)seq * num_q_heads + kvh * G) * num_splits + split;
  constexpr int kThreads = kWarps * 32;
  // Shared memory: the warps' rings [kWarps][STAGES][K, V][TILE][HD] (swizzled; over an e4m3 cache each followed
  // by the warp's fp16 copy of V [TILE][HD]), then the partition's block ids. After the stream the rings hold the
  // warps' states instead.
  extern __shared__ uint4 smem_u4[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_u4);
  unsigned char* ring = smem + warp * WARP_BYTES;
  long long* blocks = reinterpret_cast<long long*>(smem + kWarps * WARP_BYTES);
  pdl_launch_dependents();

  const int b0 = start / block_size;
  const int n = partition_start<D, kThreads>(block_tables, context_lens, blocks, start, part, block_size,
                                             max_blocks, part_row, G, num_q_heads, HD, part_out, part_max,
                                             part_sum, out, counters);
  if (n == 0) return;                            // an empty partition of a shorter sequence

  const long long kv_stride = (long long)num_kv_heads * HD;
  const int tiles = (n + TILE - 1) / TILE;
  const int my_tiles = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;
  // Issues the copies of this warp's r-th tile into its ring slot: lane takes chunk (lane % ROW_CHUNKS) of
  // tokens (32 / ROW_CHUNKS) i + lane / ROW_CHUNKS, of K and V.
  auto issue = [&](int r) {
    unsigned char* slot = ring + (r % STAGES) * STAGE_BYTES;
    const int base = (warp + r * kWarps) * TILE;
    const int sub = lane % ROW_CHUNKS;
#pragma unroll
    for (int i = 0; i < TILE * ROW_CHUNKS / 32; ++i) {
      const int tok = (32 / ROW_CHUNKS) * i + lane / ROW_CHUNKS;
      const int t = base + tok;
      const bool valid = t < n;
      const int pos = start + (valid ? t : 0);
      const long long row = (blocks[pos / block_size - b0] * block_size + pos % block_size) * kv_stride + (long long)kvh * HD;
      const unsigned dst = smem_u32(slot + tok * ROW_BYTES + ((sub ^ (tok & 7)) << 4));
      cp_async16(dst, k_cache + row + sub * (16 / KV_BYTES), valid ? 16 : 0);
      cp_async16(dst + TILE_BYTES, v_cache + row + sub * (16 / KV_BYTES), valid ? 16 : 0);
    }
  };
#pragma unroll
  for (int r = 0; r < STAGES - 1; ++r) {
    if (r < my_tiles) issue(r);
    cp_async_commit();                           // (empty groups keep the count uniform)
  }

  // Q as mma A fragments, one per 16 dims: rows quad_row and quad_row + 8 (zero past G), column pairs
  // 2 * quad_col (+ 8); over an e4m3 cache in fp16 and in the permuted order of K's fragments (dims 4 quad_col
  // and + 2, then + 1 and + 3).
  unsigned qa[HD / 16][4];
#ifdef MII_KV_FP8
  {
    const T* qh = q + ((long long)seq * num_q_heads + kvh * G) * HD;
    auto qv = [&](int row, int d) { return row < G ? Cvt<D>::load(qh[row * HD + d]) : 0.f; };
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const int d = kk * 16 + 4 * quad_col;
      qa[kk][0] = Mma<M>::pack(qv(quad_row, d), qv(quad_row, d + 2));
      qa[kk][1] = Mma<M>::pack(qv(quad_row + 8, d), qv(quad_row + 8, d + 2));
      qa[kk][2] = Mma<M>::pack(qv(quad_row, d + 1), qv(quad_row, d + 3));
      qa[kk][3] = Mma<M>::pack(qv(quad_row + 8, d + 1), qv(quad_row + 8, d + 3));
    }
  }
#else
  {
    const unsigned* q32 = reinterpret_cast<const unsigned*>(q + ((long long)seq * num_q_heads + kvh * G) * HD);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const int c = kk * 8 + quad_col;           // in 32-bit words
      qa[kk][0] = quad_row < G ? q32[quad_row * (HD / 2) + c] : 0u;
      qa[kk][1] = quad_row + 8 < G ? q32[(quad_row + 8) * (HD / 2) + c] : 0u;
      qa[kk][2] = quad_row < G ? q32[quad_row * (HD / 2) + c + 4] : 0u;
      qa[kk][3] = quad_row + 8 < G ? q32[(quad_row + 8) * (HD / 2) + c + 4] : 0u;
    }
  }
#endif
  const float kscale = scale * KV_UNIT;           // the scale of a product of Q and widened K
  const float qscale = kscale * LOG2E;
  // soft-cap: x = cap · log2 e · tanh(s · scale / cap), in log2 units as the rest
  const float cap_in = softcap > 0.f ? kscale / softcap : 0.f, cap_out = softcap * LOG2E;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};   // rows quad_row, quad_row + 8; m in log2 units
  float acc[HD / 8][4];                           // O: n-tile j's dims 8j + 2 quad_col (+1), both rows
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  // ldmatrix row addresses within a slot: lane i feeds row (i & 7) of matrix (i >> 3)
  const int mat = lane >> 3, mrow = lane & 7;
#ifndef MII_KV_FP8
  const int k_tok = (mat >> 1) * 8 + mrow, k_par = mat & 1;   // K: matrices (tokens 0-7, 8-15) x (dims lo, hi)
#endif
  const int v_tok = (mat & 1) * 8 + mrow, v_par = mat >> 1;   // V: matrices (dims lo, hi) x (tokens 0-7, 8-15)
  const float minus_inf = __int_as_float(0xff800000);

  for (int r = 0; r < my_tiles; ++r) {
    if (r + STAGES - 1 < my_tiles) issue(r + STAGES - 1);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();                 // this lane's copies of tile r have landed
    __syncwarp();                                // and every lane's of the warp
    const unsigned slot = smem_u32(ring + (r % STAGES) * STAGE_BYTES);
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};   // tokens 0-7, 8-15
#ifdef MII_KV_FP8
    // matrices (tokens 0-7, 8-15) x (16-dim chunks 2p, 2p + 1): a lane gets dims 4 quad_col … + 3 of a token
#pragma unroll
    for (int p = 0; p < HD / 32; ++p) {
      unsigned kb[4];
      ldmatrix_x4(kb, slot + ((mat & 1) * 8 + mrow) * ROW_BYTES + (((2 * p + (mat >> 1)) ^ mrow) << 4));
#pragma unroll
      for (int j = 0; j < 4; ++j)
        Mma<M>::run(s[j & 1], qa[2 * p + (j >> 1)], widen_pair_lo(kb[j]), widen_pair_hi(kb[j]));
    }
    // this tile's V, widened into the warp's fp16 copy in the 16-bit layout (chunk c of token t at c ^ (t & 7))
    unsigned char* vcopy = ring + STAGES * STAGE_BYTES;
    {
      const unsigned char* vsrc = ring + (r % STAGES) * STAGE_BYTES + TILE_BYTES;
#pragma unroll
      for (int j = 0; j < TILE * ROW_CHUNKS / 32; ++j) {
        const int idx = lane + 32 * j, tok = idx / ROW_CHUNKS, c = idx % ROW_CHUNKS;
        const uint4 w = *reinterpret_cast<const uint4*>(vsrc + tok * ROW_BYTES + ((c ^ (tok & 7)) << 4));
        uint4 lo, hi;
        widen_in_order(w.x, lo.x, lo.y);
        widen_in_order(w.y, lo.z, lo.w);
        widen_in_order(w.z, hi.x, hi.y);
        widen_in_order(w.w, hi.z, hi.w);
        *reinterpret_cast<uint4*>(vcopy + tok * (HD * 2) + (((2 * c) ^ (tok & 7)) << 4)) = lo;
        *reinterpret_cast<uint4*>(vcopy + tok * (HD * 2) + (((2 * c + 1) ^ (tok & 7)) << 4)) = hi;
      }
      __syncwarp();
    }
    const unsigned vslot = smem_u32(vcopy);
#else
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      unsigned kb[4];
      ldmatrix_x4(kb, slot + k_tok * (HD * 2) + (((2 * kk + k_par) ^ mrow) << 4));
      Mma<M>::run(s[0], qa[kk], kb[0], kb[1]);
      Mma<M>::run(s[1], qa[kk], kb[2], kb[3]);
    }
    const unsigned vslot = slot + TILE_BYTES;
#endif
    const int base = (warp + r * kWarps) * TILE;
    float p[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {                // the two rows: accumulators 0-1 and 2-3
      float mx = m[h];
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = base + half * 8 + 2 * quad_col + e;
          float x = softcap > 0.f ? cap_out * tanhf(s[half][2 * h + e] * cap_in) : s[half][2 * h + e] * qscale;
          x = t < n ? x : minus_inf;
          s[half][2 * h + e] = x;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float alpha = fast_exp2(m[h] - mx);
      m[h] = mx;
      float ps = 0.f;
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = fast_exp2(s[half][2 * h + e] - mx);
          p[half][2 * h + e] = pe;
          ps += pe;
        }
      l[h] = l[h] * alpha + ps;                  // this lane's share; the quad sums at the end
#pragma unroll
      for (int j = 0; j < HD / 8; ++j) {
        acc[j][2 * h] *= alpha;
        acc[j][2 * h + 1] *= alpha;
      }
    }
    // P as the A fragment of P . V: columns (tokens) 2 quad_col (+1) then + 8, rows quad_row (+ 8)
    const unsigned pa[4] = {Mma<M>::pack(p[0][0], p[0][1]), Mma<M>::pack(p[0][2], p[0][3]),
                            Mma<M>::pack(p[1][0], p[1][1]), Mma<M>::pack(p[1][2], p[1][3])};
#pragma unroll
    for (int c = 0; c < HD / 16; ++c) {
      unsigned vb[4];
      ldmatrix_x4_trans(vb, vslot + v_tok * (HD * 2) + (((2 * c + v_par) ^ mrow) << 4));
      Mma<M>::run(acc[2 * c], pa, vb[0], vb[1]);
      Mma<M>::run(acc[2 * c + 1], pa, vb[2], vb[3]);
    }
    __syncwarp();                                // the slot is read before a later tile's copies refill it
  }
  cp_async_wait<0>();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  __syncthreads();                               // the rings are free: they take the warps' states

  // States: acc [kWarps][MAX_G][HD], then m and l [kWarps][MAX_G] (natural-log units for m).
  float* st_acc = reinterpret_cast<float*>(smem);
  float* st_m = st_acc + kWarps * MAX_G * HD;
  float* st_l = st_m + kWarps * MAX_G;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int g = quad_row + 8 * h;
    if (g < G) {
      float* dst = st_acc + (warp * MAX_G + g) * HD + 2 * quad_col;
#pragma unroll
      for (int j = 0; j < HD / 8; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(acc[j][2 * h] * KV_UNIT, acc[j][2 * h + 1] * KV_UNIT);
      if (quad_col == 0) {
        st_m[warp * MAX_G + g] = m[h] * LN2;
        st_l[warp * MAX_G + g] = l[h];
      }
    }
  }
  __syncthreads();
  merge_states<D, kWarps, MAX_G, HD, kThreads>(st_m, st_l, st_acc, G, (long long)seq * num_q_heads + kvh * G,
                                               out, part_row, num_splits, part_out, part_max, part_sum);
  if (num_splits > 1) combine_if_last<D>(part_out, part_max, part_sum, out, counters, num_q_heads, HD, G);
}

// NAME: the kernel, WARPS per block, MIN_BLOCKS resident per SM that the register budget must allow.
#ifdef MII_KV_FP8
#define MMA_T(D) F16
#else
#define MMA_T(D) D
#endif
#define MII_MMA(NAME, WARPS, MIN_BLOCKS, D)                                                                    \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) NAME(                                  \
      const D::T* q, const KV(D)::T* k_cache, const KV(D)::T* v_cache, const long long* block_tables,        \
      const long long* context_lens, D::T* out, float* part_out, float* part_max, float* part_sum,           \
      int* counters, int num_q_heads, int num_kv_heads, int block_size, int max_blocks, int partition,       \
      int min_partition, float scale, int window, float softcap) {                                             \
    mma_partition<D, KV(D), MMA_T(D), WARPS>(q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_max,        \
                            part_sum, counters, num_q_heads, num_kv_heads, block_size, max_blocks, partition, \
                            min_partition, scale, window, softcap);                                           \
  }
MII_MMA(paged_attention_mma_bf16, 4, 3, BF16)
MII_MMA(paged_attention_mma_f16, 4, 3, F16)
MII_MMA(paged_attention_mma_w2_bf16, 2, 6, BF16)
MII_MMA(paged_attention_mma_w2_f16, 2, 6, F16)

// Shared memory a launch takes (kernels/decode_attention.py computes it): the rings, warps * WARP_BYTES
// (64 KiB for 4 warps at STAGES 2; 48 KiB over an e4m3 cache), which later hold the states (warps * MAX_G *
// (HD + 2) floats, 32.5 KiB for 4), then 8 bytes per block id of a partition.
