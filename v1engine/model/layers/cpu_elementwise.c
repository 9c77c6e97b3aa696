/* The decoder layer's two elementwise steps, each one pass per token instead of torch's several
   small ops: neox-style rotary embedding of q and k, and SiLU(gate) * up. The arithmetic and its
   roundings are rotary_embedding.py's and activation.py's (HF's): in bfloat16 every product and
   sum is rounded to bfloat16 where torch rounds it. Built into one library by
   cpu_kernel_library.py. */

#include <math.h>

#include "cpu_kernels.h"

/* Rotates each head of x ([tokens, heads, D], rows `stride` elements apart, heads contiguous) by
   cos/sin ([tokens, D]) into out ([tokens, heads, D], contiguous):
   out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]). */
#define ROTARY(NAME, T, LOAD, STORE)                                                           \
    static void NAME##_heads(const T *x, const T *cos, const T *sin, T *out, long tokens,      \
                             long heads, long D, long stride)                                  \
    {                                                                                          \
        const long half = D / 2;                                                               \
        _Pragma("omp parallel for if (tokens >= 64)")                                          \
        for (long t = 0; t < tokens; t++)                                                      \
            for (long h = 0; h < heads; h++) {                                                 \
                const T *xh = x + t * stride + h * D, *c = cos + t * D, *s = sin + t * D;      \
                T *o = out + (t * heads + h) * D;                                              \
                /* the two halves apart: one select per element kept the loop scalar */       \
                _Pragma("omp simd")                                                            \
                for (long i = 0; i < half; i++) {                                              \
                    float a = LOAD(STORE(LOAD(xh[i]) * LOAD(c[i])));                           \
                    float b = LOAD(STORE(-LOAD(xh[i + half]) * LOAD(s[i])));                   \
                    o[i] = STORE(a + b);                                                       \
                }                                                                              \
                _Pragma("omp simd")                                                            \
                for (long i = half; i < D; i++) {                                              \
                    float a = LOAD(STORE(LOAD(xh[i]) * LOAD(c[i])));                           \
                    float b = LOAD(STORE(LOAD(xh[i - half]) * LOAD(s[i])));                    \
                    o[i] = STORE(a + b);                                                       \
                }                                                                              \
            }                                                                                  \
    }                                                                                          \
                                                                                               \
    void NAME(const T *q, const T *k, const T *cos, const T *sin, T *q_out, T *k_out,          \
              long tokens, long num_heads, long num_kv_heads, long D, long q_stride,           \
              long k_stride)                                                                   \
    {                                                                                          \
        NAME##_heads(q, cos, sin, q_out, tokens, num_heads, D, q_stride);                      \
        NAME##_heads(k, cos, sin, k_out, tokens, num_kv_heads, D, k_stride);                   \
    }

/* x [tokens, 2 * d] = (gate | up) -> out [tokens, d] = silu(gate) * up. */
#define SILU_AND_MUL(NAME, T, LOAD, STORE)                                                     \
    void NAME(const T *x, T *out, long tokens, long d)                                         \
    {                                                                                          \
        _Pragma("omp parallel for if (tokens >= 64)")                                          \
        for (long t = 0; t < tokens; t++) {                                                    \
            const T *gate = x + t * 2 * d, *up = gate + d;                                     \
            T *o = out + t * d;                                                                \
            _Pragma("omp simd")                                                                \
            for (long i = 0; i < d; i++) {                                                     \
                float g = LOAD(gate[i]);                                                       \
                o[i] = STORE(LOAD(STORE(g / (1.f + v1e_expf(-g)))) * LOAD(up[i]));             \
            }                                                                                  \
        }                                                                                      \
    }

ROTARY(v1e_rotary_f32, float, AS_FLOAT, AS_FLOAT)
ROTARY(v1e_rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
SILU_AND_MUL(v1e_silu_and_mul_f32, float, AS_FLOAT, AS_FLOAT)
SILU_AND_MUL(v1e_silu_and_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
