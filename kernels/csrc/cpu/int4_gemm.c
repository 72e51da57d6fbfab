/* int4 weight-only GEMM for the CPU op set (kernels/cpu_int4.py): y [M, N] = x [M, K] · Wᵀ, x and y bf16, W in
 * 4-bit codes with a bf16 scale and offset per 32 columns of a row (w = (q - 8)·s + z: torch's int4 scheme).
 *
 * The dot products run on AVX512-BF16's vdpbf16ps, which multiplies pairs of bf16 and sums them in fp32. A code
 * q (0…15) becomes a bf16 with no arithmetic: the bits 0x4300 | q are the number 128 + q exactly, so a byte
 * holding q interleaved with the byte 0x43 is that bf16. A group of 32 columns then sums (128 + q)·x, and
 * s·(Σ(128 + q)·x - 128·Σx) + (z - 8s)·Σx is the group's share of y (Σx per group computed once per call).
 *
 * Layout (cpu_int4.py packs it): rows in blocks of 64, a block's codes [K/2][64 bytes] (one 64-byte line per
 * pair of columns k = 2p, 2p + 1), byte b = 16l + 8h + 2i + e holding the code of column 2p + e of row
 * 16h + 4l + i in its low nibble and of row 32 + 16h + 4l + i in its high nibble: the two nibble planes, each
 * unpacked with 0x43 in the low and high halves of the 128-bit lanes, give four vectors of 16 rows whose 32-bit
 * lanes are rows 0-15, 16-31, 32-47, 48-63 in order, each lane the pair (column 2p, column 2p + 1). Scales:
 * bf16 [N/64][K/32][2][64] (a block's 64 scales, then its 64 offsets, per group).
 *
 * Where the compiler has no AVX512-BF16 for this CPU, int4_gemm_native() is 0 and the op set keeps torch's kernel.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "team.h"

#define GROUP 32
#define BLOCK 64
#define MB 4            /* rows of x sharing one decode of the weights */

int int4_gemm_native(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __m512 bf16x16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* Rows m0 … m0 + mb - 1 of x against one block of 64 weight rows; mb ≤ MB, a constant where it is inlined. */
static inline __attribute__((always_inline)) void block_rows(
        const uint8_t* codes, const uint16_t* sz, int K, const uint16_t* x, const float* xs, int mb, float* out) {
    const int G = K / GROUP;
    const __m512i low = _mm512_set1_epi8(0x0F), c43 = _mm512_set1_epi8(0x43);
    __m512 y[MB][4];
    for (int m = 0; m < mb; m++)
        for (int t = 0; t < 4; t++) y[m][t] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512 a[MB][4];
        for (int m = 0; m < mb; m++)
            for (int t = 0; t < 4; t++) a[m][t] = _mm512_setzero_ps();
        const uint8_t* c = codes + (int64_t)g * (GROUP / 2) * 64;
        for (int p = 0; p < GROUP / 2; p++) {
            __m512i v = _mm512_loadu_si512((const void*)(c + p * 64));
            __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            __m512bh w[4] = {(__m512bh)_mm512_unpacklo_epi8(lo, c43), (__m512bh)_mm512_unpackhi_epi8(lo, c43),
                             (__m512bh)_mm512_unpacklo_epi8(hi, c43), (__m512bh)_mm512_unpackhi_epi8(hi, c43)};
            for (int m = 0; m < mb; m++) {
                __m512bh xp = (__m512bh)_mm512_set1_epi32(((const int32_t*)(x + (int64_t)m * K))[g * (GROUP / 2) + p]);
                for (int t = 0; t < 4; t++) a[m][t] = _mm512_dpbf16_ps(a[m][t], w[t], xp);
            }
        }
        const uint16_t* s = sz + (int64_t)g * 2 * BLOCK;
        for (int t = 0; t < 4; t++) {
            __m512 sc = bf16x16(s + 16 * t), zc = bf16x16(s + BLOCK + 16 * t);
            __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sc, zc);       /* z - 8s */
            for (int m = 0; m < mb; m++) {
                __m512 sx = _mm512_set1_ps(xs[(int64_t)m * G + g]);
                __m512 dot = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), sx, a[m][t]);   /* Σq·x */
                y[m][t] = _mm512_fmadd_ps(sc, dot, _mm512_fmadd_ps(off, sx, y[m][t]));
            }
        }
    }
    for (int m = 0; m < mb; m++)
        for (int t = 0; t < 4; t++) _mm512_storeu_ps(out + m * BLOCK + 16 * t, y[m][t]);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static void gemm_blocks(const uint8_t* codes, const uint16_t* sz, int N, int K, const uint16_t* x, const float* xs,
                        int M, uint16_t* y, int64_t b0, int64_t b1) {
    const int G = K / GROUP;
    float out[MB * BLOCK];
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t* cb = codes + b * (K / 2) * 64;
        const uint16_t* sb = sz + b * G * 2 * BLOCK;
        for (int m0 = 0; m0 < M; m0 += MB) {
            int mb = M - m0 < MB ? M - m0 : MB;
            const uint16_t* xm = x + (int64_t)m0 * K;
            const float* xsm = xs + (int64_t)m0 * G;
            switch (mb) {
                case 1: block_rows(cb, sb, K, xm, xsm, 1, out); break;
                case 2: block_rows(cb, sb, K, xm, xsm, 2, out); break;
                case 3: block_rows(cb, sb, K, xm, xsm, 3, out); break;
                default: block_rows(cb, sb, K, xm, xsm, 4, out); break;
            }
            for (int m = 0; m < mb; m++)
                for (int j = 0; j < BLOCK; j++)
                    y[(int64_t)(m0 + m) * N + b * BLOCK + j] = f32_to_bf16(out[m * BLOCK + j]);
        }
    }
}
#endif

/* y rows' columns of the 64-row blocks [b0, b1) (with a team, team.h: its units are the blocks); x [M, K] bf16,
 * y [M, N] bf16. 0, -1 out of memory, -3 not built for this CPU. */
int int4_gemm(const uint8_t* codes, const uint16_t* sz, int N, int K, const uint16_t* x, int M, uint16_t* y,
              int b0, int b1, Team* team, int owner) {
    if (team && !owner && !team_join(team)) return 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int G = K / GROUP;
    int rc = 0;
    float* xs = (float*)malloc((size_t)M * G * sizeof(float));
    if (!xs) rc = -1;
    for (int m = 0; !rc && m < M; m++)
        for (int g = 0; g < G; g++) {
            float s = 0;
            for (int i = 0; i < GROUP; i++) {
                union { uint32_t u; float f; } v = { (uint32_t)x[(int64_t)m * K + g * GROUP + i] << 16 };
                s += v.f;
            }
            xs[(int64_t)m * G + g] = s;
        }
    if (!rc) {
        int64_t from = b0, to = b1;
        if (!team) gemm_blocks(codes, sz, N, K, x, xs, M, y, from, to);
        else while (team_take(team, &from, &to)) gemm_blocks(codes, sz, N, K, x, xs, M, y, from, to);
    }
    free(xs);
    return team ? team_end(team, owner, rc) : rc;
#else
    (void)codes; (void)sz; (void)N; (void)K; (void)x; (void)M; (void)y; (void)b0; (void)b1;
    return team ? team_end(team, owner, -3) : -3;
#endif
}
