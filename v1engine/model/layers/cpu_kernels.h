/* What every CPU kernel (the C files here) shares: bfloat16 <-> float32, float loads. A
   bfloat16 is the top half of a float32; kernels compute in float32 and round once on store. */

#ifndef V1ENGINE_CPU_KERNELS_H
#define V1ENGINE_CPU_KERNELS_H

#include <math.h>
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

/* e^x in float32 to within a few ulp (Cephes' range reduction and polynomial), written without
   branches or calls so that a loop over it under `omp simd` vectorizes: glibc's expf is a call
   per element, and its vector versions need -ffast-math, which these kernels do not use (see
   cpu_gemv.c). NaN stays NaN; results below float's normal range flush to 0, above it are inf. */
static inline float v1e_expf(float x)
{
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float v = x * log2e;
    v = v > -126.f ? v : -126.f; /* so that 2^n is a normal float; also takes NaN */
    v = v < 127.f ? v : 127.f;
    float n = (v + 12582912.f) - 12582912.f; /* rounded to an integer: 1.5 * 2^23 */
    float r = x - n * ln2_hi;
    r = r - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t exponent = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &exponent, sizeof scale);
    float y = x < -87.33654475f ? 0.f : (x > 88.72283905f ? INFINITY : p * scale);
    return x != x ? x : y;
}

/* The kernels, as the C files define them (the decoder stack calls them; the Python side's
   signatures are in cpu_kernel_library.py). Per element type T, with suffix S. */
#define DECLARE_KERNELS(S, T)                                                                  \
    int v1e_gemv_##S(const T *x, const T *w, const T *b, T *y, long M, long N, long K);        \
    void v1e_rms_norm_##S(const T *x, const T *residual, const T *weight, T *sum, T *out,      \
                          long rows, long hidden, float eps);                                  \
    void v1e_rotary_##S(const T *q, const T *k, const T *cos, const T *sin, T *q_out,          \
                        T *k_out, long tokens, long num_heads, long num_kv_heads, long D,      \
                        long q_stride, long k_stride);                                         \
    void v1e_silu_and_mul_##S(const T *x, T *out, long tokens, long d);                        \
    int v1e_paged_attention_##S(const T *q, const T *k_cache, const T *v_cache,                \
                                const int32_t *block_table, const int32_t *seq_lens,           \
                                const int32_t *query_start_loc, T *out, long num_seqs,         \
                                long num_heads, long num_kv_heads, long head_size,             \
                                long block_size, long table_stride, long window, float scale, \
                                float soft_cap);

DECLARE_KERNELS(f32, float)
DECLARE_KERNELS(bf16, uint16_t)

int v1e_gemm_f32(const float *x, const float *w, const float *b, float *y, long M, long N, long K);
#if defined(__AVX512BF16__)
int v1e_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, long M,
                  long N, long K);
#endif

/* cpu_gemm_packed.c: y = x W^T (+ b) on W packed by v1e_pack_weight_f32 into panels of
   v1e_gemm_panel_width() outputs (wp holds that many floats per k per panel, zero padded). */
long v1e_gemm_panel_width(void);
void v1e_pack_weight_f32(const float *w, float *wp, long N, long K);
void v1e_gemm_packed_f32(const float *x, const float *wp, const float *b, float *y, long M,
                         long N, long K);

void v1e_write_kv(const char *key, const char *value, char *k_cache, char *v_cache,
                  const int64_t *slots, long num_tokens, long key_stride, long value_stride,
                  long row_bytes);

#endif
