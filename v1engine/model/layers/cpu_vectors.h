/* Vectors of float32 for the CPU kernels (GCC vector extensions, so the same C builds for
   AVX-512 and AVX2): LANES floats per vector, unaligned loads of float32 and bfloat16, the lane
   sums of LANES vectors at once, and the lane sum of one. */

#ifndef V1ENGINE_CPU_VECTORS_H
#define V1ENGINE_CPU_VECTORS_H

#include "cpu_kernels.h"

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef uint16_t bf16_vec_unaligned __attribute__((vector_size(LANES * 2), aligned(2)));
typedef int32_t int_vec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec load_f32(const float *p) { return *(const vec_unaligned *)p; }

#if LANES == 16
#include <immintrin.h>

/* With AVX-512, one widening load and one shift: GCC compiled the generic form below as two
   256-bit halves joined by inserts and extracts (five instructions a vector), which in the
   decode attention's value pass cost more than the multiply-adds. */
static inline vec load_bf16(const uint16_t *p)
{
    __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (vec)_mm512_slli_epi32(words, 16);
}
#else
static inline vec load_bf16(const uint16_t *p)
{
    int_vec bits = __builtin_convertvector(*(const bf16_vec_unaligned *)p, int_vec) << 16;
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
#endif

/* Lane j of the result is the sum of v[j]'s lanes: LANES horizontal sums by halving, pairing the
   vectors at each level, so that it costs about two shuffles and one add per sum. */
#if LANES == 16
static inline vec sum_lanes(const vec *v)
{
    vec a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}
#else
static inline vec sum_lanes(const vec *v)
{
    vec b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/* The sum of v's lanes, halving: lane i + lane i + LANES/2, and so on (in cpu_gemv.c, a chain
   of LANES adds, one after another, took longer than a weight row's multiply-adds at one
   token). */
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));
typedef float vec2 __attribute__((vector_size(2 * sizeof(float))));

static inline float sum_halving(vec v)
{
#if LANES == 16
    vec8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vec8 h8 = v;
#endif
    vec4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) +
              __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
    vec2 h2 = __builtin_shufflevector(h4, h4, 0, 1) + __builtin_shufflevector(h4, h4, 2, 3);
    return h2[0] + h2[1];
}

#if LANES == 16
/* Rows r[0..15] -> columns, in place: r[k][j] = old r[j][k]. Two rounds of in-lane shuffles
   transpose each 4x4 block of a 128-bit lane, two rounds of lane shuffles move the blocks. */
static inline void transpose_16x16(__m512 r[16])
{
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* u[4g + c], lane L: rows 4g..4g+3 at k = 4L + c */
        u[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
        u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        __m512 p = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
        __m512 q = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        __m512 s = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        __m512 v = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_f32x4(p, s, 0x88);
        r[4 + c] = _mm512_shuffle_f32x4(p, s, 0xDD);
        r[8 + c] = _mm512_shuffle_f32x4(q, v, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(q, v, 0xDD);
    }
}
#endif

#endif
