/* The CPU backend's native ops (kernels/cpu.py): the fused steps of a decode step between its GEMMs.
 *
 * Built at first use with the host's compiler for the host's CPU (kernels/cpu_build.py: -O3 -march=native); the
 * loops are plain C that the compiler vectorizes for what that CPU has.
 *
 * Activations are fp32 (dt 0) or bf16 (dt 1); every op computes in fp32 and rounds where the torch reference
 * rounds (a bf16 op rounds its result to nearest even), so a bf16 step gives the reference's very numbers but for
 * the order of float sums. Shapes are row-major and contiguous unless a row stride is passed. The ops that take
 * scratch memory or index the cache return 0, -1 (nothing written) when memory cannot be had, or -2 (nothing
 * written) for an index out of range: a wrong index is an error raised in Python, never a stray write.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "bf16.h"
#include "team.h"

/* What the reference computes in the activations' dtype, rounded where it rounds (bf16 ops round each result). */
static inline float round_dt(float v, int dt) { return dt ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline void load_row(const void* p, int64_t off, int n, int dt, float* out) {
    if (dt) { const uint16_t* s = (const uint16_t*)p + off; for (int i = 0; i < n; i++) out[i] = bf16_to_f32(s[i]); }
    else memcpy(out, (const float*)p + off, (size_t)n * sizeof(float));
}

static inline void store_row(void* p, int64_t off, const float* v, int n, int dt) {
    if (dt) { uint16_t* d = (uint16_t*)p + off; for (int i = 0; i < n; i++) d[i] = f32_to_bf16(v[i]); }
    else memcpy((float*)p + off, v, (size_t)n * sizeof(float));
}

/* residual' = x (+ residual); out = weight · rms_norm(residual'): the reference's order and roundings. Each loop
 * is over fp32 scratch rows, so that the compiler vectorizes it (the dtype's branches stay outside). */
int add_rms_norm(const void* x, const void* residual, void* residual_out, const void* weight, float eps,
                 int T, int H, int dt, void* out) {
    float* r = (float*)malloc((size_t)H * 3 * sizeof(float));
    if (!r) return -1;
    float *res = r + H, *w = r + 2 * H;
    load_row(weight, 0, H, dt, w);
    for (int t = 0; t < T; t++) {
        int64_t o = (int64_t)t * H;
        load_row(x, o, H, dt, r);
        if (residual) {
            load_row(residual, o, H, dt, res);
            for (int i = 0; i < H; i++) r[i] = round_dt(r[i] + res[i], dt);
        }
        double ss = 0;
        for (int i = 0; i < H; i++) ss += (double)r[i] * r[i];
        float inv = 1.0f / sqrtf((float)(ss / H) + eps);
        if (residual_out) store_row(residual_out, o, r, H, dt);
        for (int i = 0; i < H; i++) r[i] = w[i] * round_dt(r[i] * inv, dt);
        store_row(out, o, r, H, dt);
    }
    free(r);
    return 0;
}

/* e^x in plain arithmetic that the compiler vectorizes (libm's expf is a call per element): 2^n · e^r with
 * r = x - n·ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor polynomial (error below 2e-7 relative). x is clamped to
 * [-87, 88]: e^-87 (1.6e-38) is what a softmax sum or a SiLU cannot tell from 0, e^88 (1.7e38) from infinity. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_rintf(x * 1.44269504f);
    float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666667e-1f + r * (4.16666667e-2f + r * (8.33333333e-3f
              + r * 1.38888889e-3f)))));
    union { uint32_t u; float f; } two = { (uint32_t)((int32_t)n + 127) << 23 };
    return p * two.f;
}

/* x [T, 2F] = [gate | up] → act(gate) · up [T, F]; act: 0 SiLU, 1 GELU (tanh). */
void gated_act(const void* x, int T, int F, int dt, int gelu, void* out) {
    for (int t = 0; t < T; t++) {
        int64_t i0 = (int64_t)t * 2 * F, o0 = (int64_t)t * F;
        for (int i = 0; i < F; i++) {
            float g = load(x, i0 + i, dt), u = load(x, i0 + F + i, dt), a;
            if (gelu) {     /* 1 + tanh(u) = 2 - 2 / (e^2u + 1) */
                float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
                a = 0.5f * g * (2.0f - 2.0f / (exp_clamped(2.0f * u) + 1.0f));
            } else {
                a = g / (1.0f + exp_clamped(-g));
            }
            store(out, o0 + i, round_dt(a, dt) * u, dt);
        }
    }
}

/* Rotary (rotate-half) on q and k and K/V written to the caches. q, k, v: token rows `qs`, `ks`, `vs` elements
 * apart (views of one QKV row), heads D apart; cos_sin [P, D] fp32 = [cos | sin] of D/2 frequencies; caches
 * [S slots, Hkv, D] in dt; q_out [T, Hq, D]. Returns -2, nothing written, if a position or a slot is out of
 * range. */
int rotary_write_kv(const int64_t* positions, const void* q, const void* k, const void* v, int64_t qs, int64_t ks,
                    int64_t vs, const float* cos_sin, int64_t P, int T, int Hq, int Hkv, int D, int dt,
                    void* k_cache, void* v_cache, int64_t S, const int64_t* slots, void* q_out) {
    int half = D / 2;
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= P || slots[t] < 0 || slots[t] >= S) return -2;
    for (int t = 0; t < T; t++) {
        const float* cs = cos_sin + positions[t] * D;
        for (int h = 0; h < Hq + Hkv; h++) {
            const void* src = h < Hq ? q : k;
            int64_t base = (int64_t)t * (h < Hq ? qs : ks) + (int64_t)(h < Hq ? h : h - Hq) * D;
            int64_t dst = h < Hq ? ((int64_t)t * Hq + h) * D : (slots[t] * Hkv + (h - Hq)) * D;
            void* out = h < Hq ? q_out : k_cache;
            for (int i = 0; i < half; i++) {
                float c = round_dt(cs[i], dt), s = round_dt(cs[half + i], dt);
                float x1 = load(src, base + i, dt), x2 = load(src, base + half + i, dt);
                store(out, dst + i, round_dt(x1 * c, dt) - round_dt(x2 * s, dt), dt);
                store(out, dst + half + i, round_dt(x2 * c, dt) + round_dt(x1 * s, dt), dt);
            }
        }
        for (int h = 0; h < Hkv; h++) {
            int64_t base = (int64_t)t * vs + (int64_t)h * D, dst = (slots[t] * Hkv + h) * D;
            if (dt) memcpy((uint16_t*)v_cache + dst, (const uint16_t*)v + base, (size_t)D * 2);
            else memcpy((float*)v_cache + dst, (const float*)v + base, (size_t)D * 4);
        }
    }
    return 0;
}

/* Key j's K (or V) of KV head h in the cache, through the block table (bs a power of two: a shift and a mask, as
 * the block size always is here; else a division). */
static inline int64_t key_offset(const int64_t* tab, int bs, int64_t j, int Hkv, int h, int D) {
    int64_t slot = (bs & (bs - 1)) ? tab[j / bs] * bs + j % bs
                                   : tab[j >> __builtin_ctz(bs)] * bs + (j & (bs - 1));
    return (slot * Hkv + h) * D;
}


#if defined(__AVX512F__)
#include <immintrin.h>

/* n ≤ 16 vectors of a K or V row (16 lanes each) in fp32 from the cache's dtype. */
static inline void row_vectors(const void* p, int64_t off, int nv, int dt, __m512* v) {
    for (int c = 0; c < nv; c++)
        v[c] = dt ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                        _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + off + 16 * c))), 16))
                  : _mm512_loadu_ps((const float*)p + off + 16 * c);
}

/* The scores of `gn` query heads (qf, fp32 [gn][D]) against keys [lo, lo + n) of KV head h, into sc [gn][n]
 * (row stride `ld`); and their softmax-weighted sum of V rows added to acc [gn][D]. D = 16·nv, gn·nv ≤ 16: the
 * queries and the accumulators stay in registers while the keys stream by. */
static void scores_avx512(const float* qf, int gn, int nv, const void* k_cache, const int64_t* tab, int bs,
                          int64_t lo, int64_t n, int Hkv, int h, int dt, float scale, float* sc, int64_t ld) {
    __m512 qv[16], kv[16];
    int D = 16 * nv;
    for (int g = 0; g < gn; g++)
        for (int c = 0; c < nv; c++) qv[g * nv + c] = _mm512_loadu_ps(qf + g * D + 16 * c);
    for (int64_t j = 0; j < n; j++) {
        row_vectors(k_cache, key_offset(tab, bs, lo + j, Hkv, h, D), nv, dt, kv);
        for (int g = 0; g < gn; g++) {
            __m512 a = _mm512_mul_ps(qv[g * nv], kv[0]);
            for (int c = 1; c < nv; c++) a = _mm512_fmadd_ps(qv[g * nv + c], kv[c], a);
            sc[g * ld + j] = _mm512_reduce_add_ps(a) * scale;
        }
    }
}

static void values_avx512(const float* sc, int64_t ld, int gn, int nv, const void* v_cache, const int64_t* tab,
                          int bs, int64_t lo, int64_t n, int Hkv, int h, int dt, float* acc) {
    __m512 av[16], vv[16];
    int D = 16 * nv;
    for (int i = 0; i < gn * nv; i++) av[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        row_vectors(v_cache, key_offset(tab, bs, lo + j, Hkv, h, D), nv, dt, vv);
        for (int g = 0; g < gn; g++) {
            __m512 p = _mm512_set1_ps(sc[g * ld + j]);
            for (int c = 0; c < nv; c++) av[g * nv + c] = _mm512_fmadd_ps(p, vv[c], av[g * nv + c]);
        }
    }
    for (int g = 0; g < gn; g++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(acc + g * D + 16 * c, av[g * nv + c]);
}
#endif

/* Decode attention: rows [r0, r1) (one query token each) of q [R, Hq, D] over their keys, read in place from the
 * caches [N, bs, Hkv, D] through its block table (tables [R, W]); keys [lo, clen) with lo = clen - window under a
 * window; softcap > 0: scores → softcap·tanh(score / softcap). fp32 scores and softmax, out [R, Hq, D]. Returns
 * -2, nothing written, if a row's context passes its table or a block id it reads is not in [0, N). With a team
 * (team.h) the rows are its units, [r0, r1) ignored.
 * A KV head's G query heads are scored together against each key as it is read; the scores sit [G][keys] so
 * that the exponentials run over contiguous keys. */
typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *tables, *context_lens;
    int W, Hq, Hkv, D, bs, window, dt, G, wide, chunk;
    float scale, softcap;
    void* out;
    float *sc, *qf, *acc, *kv;      /* this thread's scratch */
} Attend;

/* Row r: each KV head's G query heads over the row's keys. */
static void attend_row(const Attend* c, int64_t r) {
    const int Hq = c->Hq, Hkv = c->Hkv, D = c->D, G = c->G, bs = c->bs, dt = c->dt;
    float *sc = c->sc, *qf = c->qf, *acc = c->acc, *kv = c->kv;
    int64_t clen = c->context_lens[r], lo = c->window > 0 && clen > c->window ? clen - c->window : 0, n = clen - lo;
    const int64_t* tab = c->tables + r * c->W;
    for (int h = 0; h < Hkv; h++) {
        load_row(c->q, (r * Hq + (int64_t)h * G) * D, G * D, dt, qf);
#if defined(__AVX512F__)
        if (c->wide) {
            for (int g0 = 0; g0 < G; g0 += c->chunk)
                scores_avx512(qf + g0 * D, G - g0 < c->chunk ? G - g0 : c->chunk, D / 16, c->k_cache, tab, bs, lo, n,
                              Hkv, h, dt, c->scale, sc + (int64_t)g0 * n, n);
        } else
#endif
        for (int64_t j = 0; j < n; j++) {
            load_row(c->k_cache, key_offset(tab, bs, lo + j, Hkv, h, D), D, dt, kv);
            for (int g = 0; g < G; g++) {
                const float* qq = qf + g * D;
                float s = 0;
                for (int i = 0; i < D; i++) s += qq[i] * kv[i];
                sc[(int64_t)g * n + j] = s * c->scale;
            }
        }
        for (int g = 0; g < G; g++) {
            float* row = sc + (int64_t)g * n;
            if (c->softcap > 0)
                for (int64_t j = 0; j < n; j++) row[j] = c->softcap * tanhf(row[j] / c->softcap);
            float mx = -INFINITY, sum = 0;
            for (int64_t j = 0; j < n; j++) mx = row[j] > mx ? row[j] : mx;
            for (int64_t j = 0; j < n; j++) { row[j] = exp_clamped(row[j] - mx); sum += row[j]; }
            float inv = 1.0f / sum;
            for (int64_t j = 0; j < n; j++) row[j] *= inv;
        }
#if defined(__AVX512F__)
        if (c->wide) {
            for (int g0 = 0; g0 < G; g0 += c->chunk)
                values_avx512(sc + (int64_t)g0 * n, n, G - g0 < c->chunk ? G - g0 : c->chunk, D / 16, c->v_cache, tab,
                              bs, lo, n, Hkv, h, dt, acc + g0 * D);
        } else
#endif
        {
            memset(acc, 0, (size_t)G * D * sizeof(float));
            for (int64_t j = 0; j < n; j++) {
                load_row(c->v_cache, key_offset(tab, bs, lo + j, Hkv, h, D), D, dt, kv);
                for (int g = 0; g < G; g++) {
                    float p = sc[(int64_t)g * n + j];
                    float* a = acc + g * D;
                    for (int i = 0; i < D; i++) a[i] += p * kv[i];
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < D; i++)
                store(c->out, (r * Hq + (int64_t)h * G + g) * D + i, acc[g * D + i], dt);
    }
}

int decode_attention(const void* q, const void* k_cache, const void* v_cache, int64_t N, const int64_t* tables,
                     int W, const int64_t* context_lens, int r0, int r1, int Hq, int Hkv, int D, int bs, float scale,
                     int window, float softcap, int dt, void* out, Team* team, int owner) {
    if (team && !owner && !team_join(team)) return 0;
    if (team) { r0 = 0; r1 = (int)team->total; }     /* every thread checks every row before any writes */
    int rc = 0;
    for (int r = r0; r < r1 && !rc; r++) {
        int64_t clen = context_lens[r], lo = window > 0 && clen > window ? clen - window : 0;
        if (clen < 1 || clen > (int64_t)W * bs) rc = -2;
        for (int64_t b = lo / bs; !rc && b < (clen + bs - 1) / bs; b++)
            if (tables[(int64_t)r * W + b] < 0 || tables[(int64_t)r * W + b] >= N) rc = -2;
    }
    Attend c = {q, k_cache, v_cache, tables, context_lens, W, Hq, Hkv, D, bs, window, dt, Hq / Hkv, 0, 1, scale,
                softcap, out, NULL, NULL, NULL, NULL};
#if defined(__AVX512F__)
    /* head dims of 16..256 in 16s: the vector path, query heads taken `chunk` at a time (16 registers each) */
    c.wide = D % 16 == 0 && D <= 256;
    c.chunk = c.wide && 256 / D > 1 ? 256 / D : 1;
#endif
    int64_t maxc = 0;
    for (int r = r0; r < r1; r++) if (context_lens[r] > maxc) maxc = context_lens[r];
    if (!rc) {
        c.sc = (float*)malloc((size_t)(maxc > 0 ? maxc : 1) * c.G * sizeof(float));
        c.qf = (float*)malloc((size_t)c.G * D * sizeof(float));
        c.acc = (float*)malloc((size_t)c.G * D * sizeof(float));
        c.kv = (float*)malloc((size_t)D * sizeof(float));
        if (!c.sc || !c.qf || !c.acc || !c.kv) rc = -1;
    }
    if (!rc) {
        int64_t from = r0, to = r1;
        if (!team) for (int64_t r = from; r < to; r++) attend_row(&c, r);
        else while (team_take(team, &from, &to)) for (int64_t r = from; r < to; r++) attend_row(&c, r);
    }
    free(c.sc); free(c.qf); free(c.acc); free(c.kv);
    return team ? team_end(team, owner, rc) : rc;
}
