/* A decode step's layers in one call (kernels/cpu_decode.py): each layer's norm, int4 QKV, rotary with the K/V
 * write, decode attention over the paged cache, int4 o_proj, norm, int4 gate|up, gated activation and int4 down,
 * through the very functions the op set calls one by one (cpu_ops.c, int4_gemm.c), in its order, on bf16
 * activations: the same numbers as the op-by-op step, without a return to Python between the ops. One thread. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team.h"

int add_rms_norm(const void* x, const void* residual, void* residual_out, const void* weight, float eps,
                 int T, int H, int dt, void* out);
void gated_act(const void* x, int T, int F, int dt, int gelu, void* out);
int rotary_write_kv(const int64_t* positions, const void* q, const void* k, const void* v, int64_t qs, int64_t ks,
                    int64_t vs, const float* cos_sin, int64_t P, int T, int Hq, int Hkv, int D, int dt,
                    void* k_cache, void* v_cache, int64_t S, const int64_t* slots, void* q_out);
int decode_attention(const void* q, const void* k_cache, const void* v_cache, int64_t N, const int64_t* tables,
                     int W, const int64_t* context_lens, int r0, int r1, int Hq, int Hkv, int D, int bs, float scale,
                     int window, float softcap, int dt, void* out, Team* team, int owner);
int int4_gemm(const uint8_t* codes, const uint16_t* sz, int N, int K, const uint16_t* x, int M, uint16_t* y,
              int b0, int b1, Team* team, int owner);

/* One layer's weights (NativeInt4Weight codes and scales, bf16 norms) and its caches [N, bs, Hkv, D] bf16. */
typedef struct {
    const uint16_t* attn_norm;
    const uint16_t* mlp_norm;
    const uint8_t* qkv; const uint16_t* qkv_sz;
    const uint8_t* o; const uint16_t* o_sz;
    const uint8_t* gate_up; const uint16_t* gate_up_sz;
    const uint8_t* down; const uint16_t* down_sz;
    void* k_cache; void* v_cache;
    const float* cos_sin;           /* [P, D] fp32 */
    int64_t window;                 /* 0: the whole context */
} DecodeLayer;

/* The shapes every layer shares. */
typedef struct {
    int L, H, Hq, Hkv, D, F, bs, gelu;
    float eps, scale, softcap;
    int64_t P, N;                   /* rotary positions, KV blocks */
} DecodeShape;

/* T decode rows: h [T, H] bf16, the embeddings in, the last layer's MLP output out; residual [T, H] out (the
 * stream before that output joins it). positions, slots [T]; tables [T, W]; context_lens [T]. Returns 0, -1 out
 * of memory, -2 an index out of range (nothing written by the op that found it). */
int decode_layers(const DecodeLayer* layers, const DecodeShape* s, int T, const int64_t* positions,
                  const int64_t* slots, const int64_t* tables, int W, const int64_t* context_lens, uint16_t* h,
                  uint16_t* residual) {
    const int H = s->H, Hq = s->Hq, Hkv = s->Hkv, D = s->D, F = s->F;
    const int nqkv = (Hq + 2 * Hkv) * D;
    size_t rows = (size_t)T;
    uint16_t* normed = (uint16_t*)malloc(rows * H * 2);
    uint16_t* qkv = (uint16_t*)malloc(rows * nqkv * 2);
    uint16_t* q = (uint16_t*)malloc(rows * Hq * D * 2);
    uint16_t* attn = (uint16_t*)malloc(rows * Hq * D * 2);
    uint16_t* gu = (uint16_t*)malloc(rows * 2 * F * 2);
    uint16_t* act = (uint16_t*)malloc(rows * F * 2);
    int rc = (!normed || !qkv || !q || !attn || !gu || !act) ? -1 : 0;
    const int64_t S = s->N * s->bs;
    for (int l = 0; l < s->L && rc == 0; l++) {
        const DecodeLayer* y = layers + l;
        if (l == 0) {
            memcpy(residual, h, rows * H * 2);
            rc = add_rms_norm(h, NULL, NULL, y->attn_norm, s->eps, T, H, 1, normed);
        } else {
            rc = add_rms_norm(h, residual, residual, y->attn_norm, s->eps, T, H, 1, normed);
        }
        if (rc || (rc = int4_gemm(y->qkv, y->qkv_sz, nqkv, H, normed, T, qkv, 0, nqkv / 64, NULL, 1))) break;
        rc = rotary_write_kv(positions, qkv, qkv + Hq * D, qkv + (Hq + Hkv) * D, nqkv, nqkv, nqkv, y->cos_sin, s->P,
                             T, Hq, Hkv, D, 1, y->k_cache, y->v_cache, S, slots, q);
        if (rc) break;
        rc = decode_attention(q, y->k_cache, y->v_cache, s->N, tables, W, context_lens, 0, T, Hq, Hkv, D, s->bs,
                              s->scale, (int)y->window, s->softcap, 1, attn, NULL, 1);
        if (rc || (rc = int4_gemm(y->o, y->o_sz, H, Hq * D, attn, T, h, 0, H / 64, NULL, 1))) break;
        if ((rc = add_rms_norm(h, residual, residual, y->mlp_norm, s->eps, T, H, 1, normed))) break;
        if ((rc = int4_gemm(y->gate_up, y->gate_up_sz, 2 * F, H, normed, T, gu, 0, 2 * F / 64, NULL, 1))) break;
        gated_act(gu, T, F, 1, s->gelu, act);
        rc = int4_gemm(y->down, y->down_sz, H, F, act, T, h, 0, H / 64, NULL, 1);
    }
    free(normed); free(qkv); free(q); free(attn); free(gu); free(act);
    return rc;
}
