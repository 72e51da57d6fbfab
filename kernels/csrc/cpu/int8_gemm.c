/* int8 weight-only GEMM for the CPU op set (kernels/cpu.py): y [M, N] = x [M, K] · Wᵀ with W int8 [N, K] row-major
 * and one scale per row (torch's `_weight_int8pack_mm` layout, the int4 scheme's output head). x and y are fp32
 * (dt 0) or bf16 (dt 1), the scales in the same dtype; a row's dot product is summed in fp32, times its scale,
 * rounded once to y's dtype (as torch's kernel rounds).
 *
 * A batch-1 step reads the head's 28 MB once: memory-bound, so the codes are widened to fp32 in registers
 * (AVX-512F) and each group of four weight rows runs four independent FMA chains per row of x. With several rows
 * of bf16 x the work is the products: each tile of rows is widened once, to bf16, and AVX512-BF16's pairwise dot
 * products run every row of x over it. Where the compiler
 * has no AVX-512F for this CPU, int8_gemm_native() is 0 and the op set keeps torch's kernel.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "team.h"

int int8_gemm_native(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
#include <immintrin.h>

#define RB 4            /* weight rows a pass */
#define MB 4            /* rows of x a pass */

static inline __m512 widen(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

/* Rows n0 … n0 + rb - 1 of W against rows m0 … m0 + mb - 1 of xf (fp32 [M, K]), K a multiple of 16. */
static inline __attribute__((always_inline)) void tile(const int8_t* w, int K, const float* xf, int rb, int mb,
                                                       float out[RB][MB]) {
    __m512 a[RB][MB];
    for (int r = 0; r < rb; r++)
        for (int m = 0; m < mb; m++) a[r][m] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        __m512 xv[MB];
        for (int m = 0; m < mb; m++) xv[m] = _mm512_loadu_ps(xf + (int64_t)m * K + k);
        if ((k & 63) == 0)       /* the next four rows, a line each per 64 columns: the loads find them in cache */
            for (int r = 0; r < RB; r++) _mm_prefetch((const char*)(w + (int64_t)(2 * RB + r) * K + k), _MM_HINT_T0);
        for (int r = 0; r < rb; r++) {
            __m512 wv = widen(w + (int64_t)r * K + k);
            for (int m = 0; m < mb; m++) a[r][m] = _mm512_fmadd_ps(wv, xv[m], a[r][m]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int m = 0; m < mb; m++) out[r][m] = _mm512_reduce_add_ps(a[r][m]);
}

#if defined(__AVX512BF16__)
/* Several rows of bf16 x (K a multiple of 32): each tile of weight rows is widened once, to bf16 (exact: |q| ≤
 * 127 holds in bf16's 8 bits), into `wb`, and every row of x runs over it with vdpbf16ps, two products a lane. */
static void rows_bf16(const int8_t* w, int K, const uint16_t* x, int n, int rb, uint16_t* wb,
                      float (*out)[MB], int m0, int mb) {
    if (m0 == 0)
        for (int r = 0; r < rb; r++)
            for (int k = 0; k < K; k += 16)
                _mm256_storeu_si256((__m256i*)(wb + r * K + k),
                                    (__m256i)_mm512_cvtneps_pbh(widen(w + (int64_t)(n + r) * K + k)));
    __m512 a[RB][MB];
    for (int r = 0; r < RB; r++)
        for (int m = 0; m < MB; m++) a[r][m] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __m512bh xv[MB];
        for (int m = 0; m < mb; m++) xv[m] = (__m512bh)_mm512_loadu_si512((const void*)(x + (int64_t)(m0 + m) * K + k));
        for (int r = 0; r < rb; r++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wb + r * K + k));
            for (int m = 0; m < mb; m++) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, xv[m]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int m = 0; m < mb; m++) out[r][m] = _mm512_reduce_add_ps(a[r][m]);
}
#endif
#endif

#if defined(__AVX512F__)
static int gemm_rows(const int8_t* w, const void* scale, int N, int K, const void* x, int M, int dt, void* y,
                     int64_t n0, int64_t n1, const float* xf, uint16_t* wb) {
#if defined(__AVX512BF16__)
    if (wb) {
        for (int64_t n = n0; n < n1; n += RB) {
            int rb = n1 - n < RB ? (int)(n1 - n) : RB;
            for (int m0 = 0; m0 < M; m0 += MB) {
                int mb = M - m0 < MB ? M - m0 : MB;
                float out[RB][MB];
                rows_bf16(w, K, (const uint16_t*)x, (int)n, rb, wb, out, m0, mb);
                for (int r = 0; r < rb; r++)
                    for (int m = 0; m < mb; m++)
                        store(y, (int64_t)(m0 + m) * N + n + r, out[r][m] * load(scale, n + r, dt), dt);
            }
        }
        return 0;
    }
#endif
    (void)x; (void)wb;
    for (int m0 = 0; m0 < M; m0 += MB) {
        int mb = M - m0 < MB ? M - m0 : MB;
        const float* xm = xf + (int64_t)m0 * K;
        for (int64_t n = n0; n < n1; n += RB) {
            int rb = n1 - n < RB ? (int)(n1 - n) : RB;
            float out[RB][MB];
            const int8_t* wn = w + n * K;
            if (rb == RB && mb == 1) tile(wn, K, xm, RB, 1, out);
            else if (rb == RB && mb == MB) tile(wn, K, xm, RB, MB, out);
            else tile(wn, K, xm, rb, mb, out);
            for (int r = 0; r < rb; r++)
                for (int m = 0; m < mb; m++)
                    store(y, (int64_t)(m0 + m) * N + n + r, out[r][m] * load(scale, n + r, dt), dt);
        }
    }
    return 0;
}
#endif

/* Columns [n0, n1) of y (with a team, team.h: its units are the rows of W, taken in multiples of 4). Returns 0,
 * -1 out of memory, -3 not built for this CPU or K not a multiple of 16. */
int int8_gemm(const int8_t* w, const void* scale, int N, int K, const void* x, int M, int dt, void* y, int n0,
              int n1, Team* team, int owner) {
    if (team && !owner && !team_join(team)) return 0;
#if defined(__AVX512F__)
    int rc = K % 16 ? -3 : 0;
    float* xf = NULL;
    uint16_t* wb = NULL;
#if defined(__AVX512BF16__)
    if (!rc && M > 1 && dt == 1 && K % 32 == 0) {
        wb = (uint16_t*)malloc((size_t)RB * K * sizeof(uint16_t));
        if (!wb) rc = -1;
    } else
#endif
    if (!rc) {
        xf = (float*)malloc((size_t)M * K * sizeof(float));
        if (!xf) rc = -1;
        for (int64_t i = 0; !rc && i < (int64_t)M * K; i++) xf[i] = load(x, i, dt);
    }
    if (!rc) {
        int64_t from = n0, to = n1;
        if (!team) gemm_rows(w, scale, N, K, x, M, dt, y, from, to, xf, wb);
        else while (team_take(team, &from, &to)) gemm_rows(w, scale, N, K, x, M, dt, y, from, to, xf, wb);
    }
    free(xf);
    free(wb);
    return team ? team_end(team, owner, rc) : rc;
#else
    (void)w; (void)scale; (void)N; (void)K; (void)x; (void)M; (void)dt; (void)y; (void)n0; (void)n1;
    return team ? team_end(team, owner, -3) : -3;
#endif
}
