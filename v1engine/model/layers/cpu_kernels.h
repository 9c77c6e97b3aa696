/* What every CPU kernel (the C files here) shares: bfloat16 <-> float32, float loads. A
   bfloat16 is the top half of a float32; kernels compute in float32 and round once on store. */

#ifndef V1ENGINE_CPU_KERNELS_H
#define V1ENGINE_CPU_KERNELS_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v)
{
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch does; NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#define AS_FLOAT(v) (v)

#endif
