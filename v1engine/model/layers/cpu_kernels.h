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

/* The kernels, as the C files define them (the decoder stack calls them; the Python side's
   signatures are in cpu_kernel_library.py). Per element type T, with suffix S. */
#define DECLARE_KERNELS(S, T)                                                                  \
    void v1e_gemv_##S(const T *x, const T *w, const T *b, T *y, long M, long N, long K);       \
    void v1e_rms_norm_##S(const T *x, const T *residual, const T *weight, T *sum, T *out,      \
                          long rows, long hidden, float eps);                                  \
    void v1e_rotary_##S(const T *q, const T *k, const T *cos, const T *sin, T *q_out,          \
                        T *k_out, long tokens, long num_heads, long num_kv_heads, long D,      \
                        long q_stride, long k_stride);                                         \
    void v1e_silu_and_mul_##S(const T *x, T *out, long tokens, long d);                        \
    int v1e_decode_attention_##S(const T *q, const T *k_cache, const T *v_cache,               \
                                 const int32_t *block_table, const int32_t *seq_lens, T *out,  \
                                 long num_seqs, long num_heads, long num_kv_heads,             \
                                 long head_size, long block_size, long table_stride,           \
                                 long window, float scale);

DECLARE_KERNELS(f32, float)
DECLARE_KERNELS(bf16, uint16_t)

void v1e_write_kv(const char *key, const char *value, char *k_cache, char *v_cache,
                  const int64_t *slots, long num_tokens, long key_stride, long value_stride,
                  long row_bytes);

#endif
