// A mixture-of-experts layer for a few tokens (a decode step's), where the time is reading the chosen experts'
// weights once. The router's logits come first, from gemv.cu (the norm its prologue, fp32 out); then
//   moe_gate_up  for each (token, slot) pair, h [T k, F] = silu(gate_e · xin) * (up_e · xin): e is the slot's
//                expert, chosen from the token's logits by softmax top-k (one warp of every block repeats the
//                choice, so that no kernel of its own sits between the router and the experts), and xin is the
//                RMSNorm of the token's residual stream (recomputed by every block, as gemv.cu computes it, so
//                that it equals the router's input bit for bit). The blocks of column 0 write each pair's
//                routing weight and expert. moe_gate_up_every_warp: every warp makes the choice itself and
//                issues its first weight loads before xin is staged (the same bits).
//   moe_down     y [T, H] = Σ_slot weight · (down_e · h[pair]): each expert's product rounded to the storage
//                type, the weights too, the sum in fp32 — the grouped path's bmm, in one pass: a warp takes an
//                output row of every slot in turn.
//   moe_down_wide  the same where F is a multiple of 256 (each 32-lane slice of chunks within one slot): a warp
//                reads an output row of all the slots as one row of k·F (the slots' rows end to end), MOE_UNROLL
//                chunks a lane at a step whichever slot they are in, so that a row of Qwen3-MoE's F = 768 takes
//                3 steps of 8 loads in flight, not 8 steps of 3 (the host picks it where it saves steps). Each
//                lane visits its chunks of a slot in the same order as moe_down, so the two give the same bits.
// Weight rows are read as in gemv.cu: lane-interleaved 16-byte chunks, the next group in flight while this one
// is multiplied. Only 16-bit types; the host requires H % 8 == 0, F % 8 == 0, 16-byte aligned rows, at most
// MOE_MAX_E experts and MOE_MAX_K of them a token.
#include "gemv_common.cuh"

#define MOE_WARPS 8
#define MOE_THREADS (MOE_WARPS * 32)
#define MOE_UNROLL 8
#define MOE_MAX_E 256           // router logits one warp holds: 8 a lane
#define MOE_MAX_K 16
#define STAGE 4                 // xin chunks per thread in flight while staging
#define NEG_INF __int_as_float(0xff800000)

// Softmax top-k of one token's logits [E] by one warp, as reference.moe_route: the k largest in descending
// order (the lower expert first among equals), each weight exp(l - max) / Σ exp(l - max) in fp32, divided by
// the chosen weights' sum with `renorm`. Every lane ends with all k. A NaN logit counts as -inf, and -inf ones
// are chosen in expert order when fewer than k are larger, so that every id names an expert whatever the
// logits (the weights are then NaN, as the model's numbers already are); NaN marks an expert taken, or none.
__device__ __forceinline__ void route(const float* __restrict__ logits, int e_count, int top_k, int renorm,
                                      int* ids, float* weights, int lane) {
  float v[MOE_MAX_E / 32];
  float mx = NEG_INF;
#pragma unroll
  for (int j = 0; j < MOE_MAX_E / 32; ++j) {
    const int e = lane + 32 * j;
    const float l = e < e_count ? logits[e] : __int_as_float(0x7fc00000);
    v[j] = e < e_count && isnan(l) ? NEG_INF : l;
    mx = fmaxf(mx, v[j]);                        // fmaxf passes over the NaN of no expert
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < MOE_MAX_E / 32; ++j) sum += (lane + 32 * j < e_count) ? expf(v[j] - mx) : 0.f;
  sum = warp_sum(sum);
  float chosen = 0.f;
  for (int r = 0; r < top_k; ++r) {
    float best = NEG_INF;
    int at = 1 << 30;                                          // none yet: loses every comparison below
#pragma unroll
    for (int j = 0; j < MOE_MAX_E / 32; ++j)                  // ascending j: the lowest expert among equals
      if (!isnan(v[j]) && (v[j] > best || at == 1 << 30)) { best = v[j]; at = lane + 32 * j; }
    for (int o = 16; o > 0; o >>= 1) {
      const float b = __shfl_xor_sync(0xffffffffu, best, o);
      const int a = __shfl_xor_sync(0xffffffffu, at, o);
      if (b > best || (b == best && a < at)) { best = b; at = a; }
    }
    if ((at & 31) == lane) v[at >> 5] = __int_as_float(0x7fc00000);
    ids[r] = at;
    weights[r] = expf(best - mx) / sum;
    chosen += weights[r];
  }
  if (renorm)
    for (int r = 0; r < top_k; ++r) weights[r] /= chosen;
}

template <typename D, bool EVERY_WARP>
__device__ void moe_gate_up(const typename D::T* __restrict__ x, long long x_stride,
                            const typename D::T* __restrict__ norm_w, float eps, const float* __restrict__ logits,
                            int e_count, int top_k, int renorm, const typename D::T* __restrict__ w,
                            typename D::T* __restrict__ h, float* __restrict__ weights_out,
                            long long* __restrict__ ids_out, int f, int k, int rows_per_warp) {
  typedef typename D::T T;
  extern __shared__ uint4 xs[];                  // [kc] xin of this pair's token
  __shared__ int s_expert;
  __shared__ float red[MOE_WARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kc = k / 8;
  const int pair = blockIdx.y, tok = pair / top_k, slot = pair % top_k;
  const long long row0 = ((long long)blockIdx.x * MOE_WARPS + warp) * rows_per_warp;
  const int nrows = (int)max(0LL, min((long long)rows_per_warp, (long long)f - row0));
  const int groups = (kc + MOE_UNROLL * 32 - 1) / (MOE_UNROLL * 32);
  const int steps = nrows * groups * 2;
  pdl_launch_dependents();
  pdl_wait();                                    // the logits and the residual stream are the router's

  const uint4* w4 = nullptr;                     // the slot's expert's [gate | up] rows
  uint4 cur[MOE_UNROLL];
  auto load = [&](uint4 (&r)[MOE_UNROLL], int s) {
    const uint4* wr = w4 + step_row<EPI_SILU>(row0, s, groups, f) * kc;
    const int c0 = (s % groups) * MOE_UNROLL * 32 + lane;
#pragma unroll
    for (int u = 0; u < MOE_UNROLL; ++u) {
      const int c = c0 + u * 32;
      if (s < steps && c < kc) r[u] = load_stream(wr + c);
      else r[u].x = r[u].y = r[u].z = r[u].w = 0u;
    }
  };
  // EVERY_WARP: each warp routes and issues its first weight loads at once, before xin is staged; else warp 0
  // routes for the block while the others stage.
  if (EVERY_WARP || warp == 0) {
    int ids[MOE_MAX_K];
    float wts[MOE_MAX_K];
    route(logits + (long long)tok * e_count, e_count, top_k, renorm, ids, wts, lane);
    if (EVERY_WARP) {
      w4 = reinterpret_cast<const uint4*>(w) + (long long)ids[slot] * 2 * f * kc;
      load(cur, 0);
    } else if (lane == 0) {
      s_expert = ids[slot];
    }
    if (warp == 0 && lane == 0 && blockIdx.x == 0) {
      weights_out[pair] = wts[slot];
      ids_out[pair] = ids[slot];
    }
  }
  // xin = rms_norm(x): the sum of squares in gemv.cu's order (its thread mapping and passes), so that xin is the
  // router's input bit for bit.
  float ss = 0.f;
  const uint4* xr = reinterpret_cast<const uint4*>(x + tok * x_stride);
  for (int c0 = threadIdx.x; c0 < kc; c0 += STAGE * MOE_THREADS) {
    uint4 xv[STAGE];
#pragma unroll
    for (int j = 0; j < STAGE; ++j)
      if (c0 + j * MOE_THREADS < kc) xv[j] = xr[c0 + j * MOE_THREADS];
#pragma unroll
    for (int j = 0; j < STAGE; ++j) {
      const int c = c0 + j * MOE_THREADS;
      if (c >= kc) continue;
      float v[8];
      unpack8<D>(xv[j], v);
      xs[c] = xv[j];
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += v[e] * v[e];
    }
  }
  ss = warp_sum(ss);
  if (lane == 0) red[warp] = ss;
  __syncthreads();                               // the expert is known, xs staged

  if (!EVERY_WARP) {
    w4 = reinterpret_cast<const uint4*>(w) + (long long)s_expert * 2 * f * kc;
    load(cur, 0);                                // in flight while the norm finishes
  }
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < MOE_WARPS; ++i) total += red[i];
  const float inv = rsqrtf(total / k + eps);
  const uint4* nw = reinterpret_cast<const uint4*>(norm_w);
  for (int c = threadIdx.x; c < kc; c += MOE_THREADS) {          // the same thread staged this chunk above
    float v[8], g[8];
    unpack8<D>(xs[c], v);
    unpack8<D>(nw[c], g);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = g[e] * round_to<D>(v[e] * inv);
    xs[c] = pack8<D>(v);
  }
  __syncthreads();

  float acc = 0.f, gate = 0.f;
  T* hp = h + (long long)pair * f;
  for (int s = 0; s < steps; ++s) {
    uint4 nxt[MOE_UNROLL];
    load(nxt, s + 1);
    const int g = s % groups;
    const int c0 = g * MOE_UNROLL * 32 + lane;
#pragma unroll
    for (int u = 0; u < MOE_UNROLL; ++u) {
      const int c = c0 + u * 32;
      if (c < kc) {
        float wf[8], xf[8];
        unpack8<D>(cur[u], wf);
        unpack8<D>(xs[c], xf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc = fmaf(wf[j], xf[j], acc);
      }
      cur[u] = nxt[u];
    }
    if (g == groups - 1) {                       // a row is done: the gate row, then its up row
      const int q = s / groups;
      const float v = warp_sum(acc);
      acc = 0.f;
      if ((q & 1) == 0) {
        gate = round_to<D>(v);
      } else if (lane == 0) {
        hp[row0 + (q >> 1)] = Cvt<D>::store(gated<D, EPI_SILU>(gate, round_to<D>(v)));
      }
    }
  }
}

// moe_down's inputs for token `tok`: its pairs' experts and routing weights (rounded to the storage type) and
// their h [top_k, F], staged in shared memory for the block.
template <typename D>
__device__ __forceinline__ void stage_down(const typename D::T* __restrict__ h, const float* __restrict__ weights,
                                           const long long* __restrict__ ids, int top_k, int f, int tok,
                                           long long* s_ids, float* s_w, uint4* hs) {
  if (threadIdx.x < top_k) {
    s_ids[threadIdx.x] = ids[(long long)tok * top_k + threadIdx.x];
    s_w[threadIdx.x] = round_to<D>(weights[(long long)tok * top_k + threadIdx.x]);
  }
  const uint4* hr = reinterpret_cast<const uint4*>(h + (long long)tok * top_k * f);
  for (int c = threadIdx.x; c < top_k * (f / 8); c += MOE_THREADS) hs[c] = hr[c];
  __syncthreads();
}

template <typename D>
__device__ void moe_down(const typename D::T* __restrict__ h, const float* __restrict__ weights,
                         const long long* __restrict__ ids, int top_k, const typename D::T* __restrict__ w,
                         typename D::T* __restrict__ y, int n, int f, int rows_per_warp) {
  extern __shared__ uint4 hs[];                  // [top_k, fc]: this token's pairs' h
  __shared__ long long s_ids[MOE_MAX_K];
  __shared__ float s_w[MOE_MAX_K];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, fc = f / 8, tok = blockIdx.y;
  const long long row0 = ((long long)blockIdx.x * MOE_WARPS + warp) * rows_per_warp;
  const int nrows = (int)max(0LL, min((long long)rows_per_warp, (long long)n - row0));
  const int groups = (fc + MOE_UNROLL * 32 - 1) / (MOE_UNROLL * 32);
  const int per_row = groups * top_k;            // steps of one output row: every slot's row, group by group
  const int steps = nrows * per_row;
  pdl_launch_dependents();
  pdl_wait();                                    // h, ids and weights are moe_gate_up's
  stage_down<D>(h, weights, ids, top_k, f, tok, s_ids, s_w, hs);

  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  auto load = [&](uint4 (&r)[MOE_UNROLL], int s) {
    const int slot = (s / groups) % top_k;
    const uint4* wr = w4 + (s_ids[s < steps ? slot : 0] * n + row0 + s / per_row) * fc;
    const int c0 = (s % groups) * MOE_UNROLL * 32 + lane;
#pragma unroll
    for (int u = 0; u < MOE_UNROLL; ++u) {
      const int c = c0 + u * 32;
      if (s < steps && c < fc) r[u] = load_stream(wr + c);
      else r[u].x = r[u].y = r[u].z = r[u].w = 0u;
    }
  };
  uint4 cur[MOE_UNROLL];
  load(cur, 0);
  float acc = 0.f, sum = 0.f;
  for (int s = 0; s < steps; ++s) {
    uint4 nxt[MOE_UNROLL];
    load(nxt, s + 1);
    const int g = s % groups, slot = (s / groups) % top_k;
    const int c0 = g * MOE_UNROLL * 32 + lane;
#pragma unroll
    for (int u = 0; u < MOE_UNROLL; ++u) {
      const int c = c0 + u * 32;
      if (c < fc) {
        float wf[8], hf[8];
        unpack8<D>(cur[u], wf);
        unpack8<D>(hs[slot * fc + c], hf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc = fmaf(wf[j], hf[j], acc);
      }
      cur[u] = nxt[u];
    }
    if (g == groups - 1) {                       // this slot's product of the row is done
      sum = fmaf(s_w[slot], round_to<D>(warp_sum(acc)), sum);
      acc = 0.f;
      if (slot == top_k - 1) {
        if (lane == 0) y[(long long)tok * n + row0 + s / per_row] = Cvt<D>::store(sum);
        sum = 0.f;
      }
    }
  }
}

template <typename D>
__device__ void moe_down_wide(const typename D::T* __restrict__ h, const float* __restrict__ weights,
                              const long long* __restrict__ ids, int top_k, const typename D::T* __restrict__ w,
                              typename D::T* __restrict__ y, int n, int f, int rows_per_warp) {
  extern __shared__ uint4 hs[];                  // [top_k, fc]: this token's pairs' h, the row the weights meet
  __shared__ long long s_ids[MOE_MAX_K];
  __shared__ float s_w[MOE_MAX_K];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, fc = f / 8, tok = blockIdx.y;
  const int vc = top_k * fc;                     // chunks of a row over every slot
  const long long row0 = ((long long)blockIdx.x * MOE_WARPS + warp) * rows_per_warp;
  const int nrows = (int)max(0LL, min((long long)rows_per_warp, (long long)n - row0));
  const int groups = (vc + MOE_UNROLL * 32 - 1) / (MOE_UNROLL * 32);
  const int steps = nrows * groups;
  pdl_launch_dependents();
  pdl_wait();                                    // h, ids and weights are moe_gate_up's
  stage_down<D>(h, weights, ids, top_k, f, tok, s_ids, s_w, hs);

  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  // Chunk v of the row (warp-uniform base v0 = v - lane) lies in slot v0 / fc, at v0 - slot·fc of the slot's
  // expert's row. One division a call: the slices advance by 32 and fc is a multiple of 32, so a slice crosses
  // into the next slot exactly where its offset reaches fc.
  auto load = [&](uint4 (&r)[MOE_UNROLL], int s) {
    const long long row = row0 + s / groups;
    const int base = (s % groups) * MOE_UNROLL * 32;
    int sl = base / fc, off = base - sl * fc;
#pragma unroll
    for (int u = 0; u < MOE_UNROLL; ++u) {
      if (off == fc) { off = 0; ++sl; }
      if (s < steps && base + u * 32 < vc) r[u] = load_stream(w4 + (s_ids[sl] * n + row) * fc + off + lane);
      else r[u].x = r[u].y = r[u].z = r[u].w = 0u;
      off += 32;
    }
  };
  uint4 cur[MOE_UNROLL];
  load(cur, 0);
  float acc = 0.f, sum = 0.f;
  int slot = 0, slot_end = fc;                   // the chunk at which the next slot starts
  for (int s = 0; s < steps; ++s) {
    uint4 nxt[MOE_UNROLL];
    load(nxt, s + 1);
    const int base = (s % groups) * MOE_UNROLL * 32;
#pragma unroll
    for (int u = 0; u < MOE_UNROLL; ++u) {
      const int v0 = base + u * 32;
      if (v0 < vc) {
        if (v0 == slot_end) {                    // the slot's product is done (warp-uniform)
          sum = fmaf(s_w[slot], round_to<D>(warp_sum(acc)), sum);
          acc = 0.f;
          ++slot;
          slot_end += fc;
        }
        float wf[8], hf[8];
        unpack8<D>(cur[u], wf);
        unpack8<D>(hs[v0 + lane], hf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc = fmaf(wf[j], hf[j], acc);
      }
      cur[u] = nxt[u];
    }
    if (s % groups == groups - 1) {              // the row is done: its last slot, then the output
      sum = fmaf(s_w[slot], round_to<D>(warp_sum(acc)), sum);
      if (lane == 0) y[(long long)tok * n + row0 + s / groups] = Cvt<D>::store(sum);
      acc = sum = 0.f;
      slot = 0;
      slot_end = fc;
    }
  }
}

#define MII_MOE(SUFFIX, D)                                                                                     \
  extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2) moe_gate_up_##SUFFIX(                           \
      const D::T* x, long long x_stride, const D::T* norm_w, float eps, const float* logits, int e_count,       \
      int top_k, int renorm, const D::T* w, D::T* h, float* weights_out, long long* ids_out, int f, int k,      \
      int rows_per_warp) {                                                                                     \
    moe_gate_up<D, false>(x, x_stride, norm_w, eps, logits, e_count, top_k, renorm, w, h, weights_out, ids_out, \
                          f, k, rows_per_warp);                                                                \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2) moe_gate_up_every_warp_##SUFFIX(                \
      const D::T* x, long long x_stride, const D::T* norm_w, float eps, const float* logits, int e_count,       \
      int top_k, int renorm, const D::T* w, D::T* h, float* weights_out, long long* ids_out, int f, int k,      \
      int rows_per_warp) {                                                                                     \
    moe_gate_up<D, true>(x, x_stride, norm_w, eps, logits, e_count, top_k, renorm, w, h, weights_out, ids_out,  \
                         f, k, rows_per_warp);                                                                 \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2) moe_down_##SUFFIX(                              \
      const D::T* h, const float* weights, const long long* ids, int top_k, const D::T* w, D::T* y, int n,      \
      int f, int rows_per_warp) {                                                                              \
    moe_down<D>(h, weights, ids, top_k, w, y, n, f, rows_per_warp);                                            \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2) moe_down_wide_##SUFFIX(                         \
      const D::T* h, const float* weights, const long long* ids, int top_k, const D::T* w, D::T* y, int n,      \
      int f, int rows_per_warp) {                                                                              \
    moe_down_wide<D>(h, weights, ids, top_k, w, y, n, f, rows_per_warp);                                       \
  }
MII_MOE(bf16, BF16)
MII_MOE(f16, F16)
