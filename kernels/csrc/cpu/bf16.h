/* bf16 ⇄ fp32 for the CPU op set's C files, and element access in an activations' dtype (dt 0 fp32, 1 bf16).
 * fp32 → bf16 rounds to nearest even, as torch does; a NaN stays a NaN. */
#ifndef MII_BF16_H
#define MII_BF16_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x7fffffu))
        return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float load(const void* p, int64_t i, int dt) {
    return dt ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

static inline void store(void* p, int64_t i, float v, int dt) {
    if (dt) ((uint16_t*)p)[i] = f32_to_bf16(v); else ((float*)p)[i] = v;
}
#endif
