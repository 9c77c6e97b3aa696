/* y[m, :] = x[m, :] W^T (+ b) for a batch of a few dozen tokens: the matmul of a CPU decode step
   with more requests than the kernel on packed weights takes (cpu_gemm_packed.c), float32, and of
   any step on a layer without packed weights; and in bfloat16, on CPUs with AVX512-BF16, of every
   step past the gemv's few tokens.

   At 9 to 64 tokens GEMM libraries are at their weakest (oneDNN and MKL ran 90-130 GFLOP/s here
   where they reach 200-250 on prefills; scripts/bench_gemm.py), while each weight is still read
   from memory once per step. This kernel keeps the weights in nn.Linear's layout and copies the
   tokens instead: x is packed once per call into panels of up to `vecs` * LANES tokens, k-major
   ([K][panel width], zero padded), so that one vector load gives one k for LANES tokens. Both
   threads pack, 16 x 16 blocks transposed in registers (packed by one thread with scalar stores,
   the copy was ~12% of a 64-token call while the other thread spun; a step's matmuls are now 3-7%
   faster at 1-64 tokens). Each
   task takes `rows` weight rows (outputs) and, for every panel, accumulates

       acc[i][c] += W[n + i, k] * xp[k][c * LANES .. c * LANES + LANES - 1]     for k = 0 .. K-1

   in rows x vecs vector registers: per k, `rows` broadcasts of a weight and `vecs` loads of
   tokens feed rows * vecs fused multiply-adds. With AVX-512 a call takes tiles of 8 rows x 3
   vectors (8 + 3 loads per 24 FMAs) up to 48 tokens, and 6 x 4 past that: 49-64 tokens in one
   panel instead of 48 + 16 (the 16 at a third of the FMAs per load), 12-17% faster at 56-64 in a
   same-run bench. Each weight row is streamed once per panel, and the rows of the thread's next
   tile are prefetched while this one runs (its rows are contiguous in w: a tile ahead is far
   enough to hide the memory's latency, a few cache lines ahead was not). The tile is then
   transposed into y. Every output is one float32 multiply-add chain in k order, so a
   row's result does not depend on which other rows share the call.

   bfloat16 runs the same code on pairs of k: a pair is one 32-bit unit of x's rows and of w's, so
   the panels, the transposes and the broadcasts move pairs where float32 moves floats, and the
   multiply-add is AVX512-BF16's dot product (VDPBF16PS: per lane, the odd k's product, then the
   even one's, each exact and each sum rounded to float32), which does twice a float32 FMA's
   arithmetic per instruction. The sum (+ bias) is rounded to bfloat16 once. SmolLM2's step of
   matmuls took 1.2-1.9x less time than oneDNN's bfloat16 linear at 16-128 tokens on a Zen 5
   (cpu_kernels.py has the figures); K must be even.

   Compiled with the other kernels (cpu_kernel_library.py: -O3 -march=native -fopenmp); the vector
   width follows the ISA (16 lanes with AVX-512, 8 otherwise, in tiles of 4 x 3 to fit 16
   registers). x [M, K], w [N, K], b [N] or NULL, y [M, N], all row-major and contiguous. Returns
   nonzero if the packed copy of x could not be allocated. */

#include <stdlib.h>

#include "cpu_vectors.h"

/* Tile geometries (weight rows x vectors of tokens); the accumulators, the token vectors and a
   broadcast weight must fit the vector registers (32 with AVX-512, 16 with AVX2). */
struct geometry {
    int rows, vecs;
};
#if LANES == 16
#define MAX_ROWS 8
static const struct geometry NARROW = {8, 3}, WIDE = {6, 4};
#else
#define MAX_ROWS 4
static const struct geometry NARROW = {4, 3}, WIDE = {4, 3};
#endif

/* Both element types run one code, on "units": a float32 is one unit, a pair of bfloat16 along k
   another (32 bits each), so that a token's panel column and a weight's broadcast are 32-bit
   lanes either way. `madd_S` adds one unit's products into a vector of LANES tokens' sums;
   `store_S` rounds a sum (+ bias) to the output type. */
static inline vec madd_f32(vec acc, float weight, vec tokens) { return acc + weight * tokens; }
static inline float store_f32(float sum, const float *bias, int i)
{
    return sum + (bias ? bias[i] : 0.f);
}

#if defined(__AVX512BF16__)
/* AVX512-BF16's dot product: per lane, acc += x[k + 1] w[k + 1], then acc += x[k] w[k], each
   product exact and each sum rounded to float32 (denormal inputs and results read as zero). */
static inline vec madd_bf16(vec acc, uint32_t weights, vec tokens)
{
    return (vec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)tokens,
                                 (__m512bh)_mm512_set1_epi32((int)weights));
}
static inline uint16_t store_bf16(float sum, const uint16_t *bias, int i)
{
    return f32_to_bf16(sum + (bias ? bf16_to_f32(bias[i]) : 0.f));
}
#endif

/* ROWS outputs (weight rows `w`, of which `rows` are real, K units each) for the `cols` tokens of
   one panel of VECS vectors; xp is the panel, y the tile's top-left output. */
#define GEMM_TILE(S, U, T, ROWS, VECS)                                                         \
    static void tile_##S##_##ROWS##x##VECS(const U *const *w, const uint32_t *restrict xp,     \
                                           T *y, const T *bias, long N, long K, int rows,      \
                                           int cols)                                           \
    {                                                                                          \
        vec acc[ROWS][VECS];                                                                   \
        _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++)                                 \
            _Pragma("GCC unroll 4") for (int c = 0; c < VECS; c++) acc[i][c] = (vec){0};       \
        for (long k = 0; k < K; k++) {                                                         \
            if (k % 16 == 0) /* the same k of the next tile's rows: ROWS rows ahead */         \
                _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++)                         \
                    __builtin_prefetch(w[i] + k + ROWS * K);                                   \
            vec tokens[VECS];                                                                  \
            _Pragma("GCC unroll 4") for (int c = 0; c < VECS; c++)                             \
                tokens[c] = *(const vec *)(xp + k * VECS * LANES + c * LANES);                 \
            _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) {                           \
                U weight = w[i][k];                                                            \
                _Pragma("GCC unroll 4") for (int c = 0; c < VECS; c++)                         \
                    acc[i][c] = madd_##S(acc[i][c], weight, tokens[c]);                        \
            }                                                                                  \
        }                                                                                      \
        float out[ROWS][VECS * LANES];                                                         \
        _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++)                                 \
            _Pragma("GCC unroll 4") for (int c = 0; c < VECS; c++)                             \
                *(vec_unaligned *)&out[i][c * LANES] = acc[i][c];                              \
        for (int j = 0; j < cols; j++)                                                         \
            for (int i = 0; i < rows; i++) y[j * N + i] = store_##S(out[i][j], bias, i);       \
    }

/* Tokens m0.. go in a panel of `panel`, or of the fewest whole vectors that hold the rest. */
static long panel_width(long m0, long M, long panel)
{
    long rest = M - m0;
    return rest >= panel ? panel : (rest + LANES - 1) / LANES * LANES;
}

#if LANES == 16
/* 16 tokens from x (rows `real` and past: zeros) x units k0..k1 (at most 16) -> dst[k][16], row
   stride `width` units. */
static void pack_block(const uint32_t *x, uint32_t *dst, long K, long real, long k0, long k1,
                       long width)
{
    __m512 r[16];
    const __mmask16 mask = (__mmask16)((1u << (k1 - k0)) - 1);
    for (int j = 0; j < 16; j++)
        r[j] = j < real ? _mm512_maskz_loadu_ps(mask, x + j * K + k0) : _mm512_setzero_ps();
    transpose_16x16(r); /* moves bits: a pair of bfloat16 travels as one lane */
    for (long k = k0; k < k1; k++) _mm512_store_ps((float *)(dst + k * width), r[k - k0]);
}
#endif

/* x [M, K units] -> one [K][width] panel per panel_width, zero padded, 16 tokens x 16 units at a
   time. Called inside the parallel region: the threads share the chunks of k. */
static void pack_tokens(const uint32_t *x, uint32_t *xp, long M, long K, long panel)
{
    for (long m0 = 0; m0 < M; m0 += panel) {
        long width = panel_width(m0, M, panel), real = M - m0 < width ? M - m0 : width;
        uint32_t *dst = xp + m0 * K;
#pragma omp for schedule(static) nowait
        for (long k0 = 0; k0 < K; k0 += 16) {
            long k1 = k0 + 16 < K ? k0 + 16 : K;
#if LANES == 16
            for (long j0 = 0; j0 < width; j0 += 16)
                pack_block(x + (m0 + j0) * K, dst + j0, K, real - j0, k0, k1, width);
#else
            for (long j = 0; j < width; j++)
                for (long k = k0; k < k1; k++)
                    dst[k * width + j] = j < real ? x[(m0 + j) * K + k] : 0u;
#endif
        }
    }
}

/* The tiles, the choice among them, this thread's share of them (every panel of tokens times
   `rows` weight rows at a time) and the entry point, per element type; K counts units. */
#if LANES == 16
#define TILES(S, U, T)                                                                         \
    GEMM_TILE(S, U, T, 8, 1) GEMM_TILE(S, U, T, 8, 2) GEMM_TILE(S, U, T, 8, 3)                 \
    GEMM_TILE(S, U, T, 6, 1) GEMM_TILE(S, U, T, 6, 2) GEMM_TILE(S, U, T, 6, 3)                 \
    GEMM_TILE(S, U, T, 6, 4)                                                                   \
    typedef void (*tile_fn_##S)(const U *const *, const uint32_t *, T *, const T *, long,      \
                                long, int, int);                                               \
    static tile_fn_##S tile_for_##S(struct geometry g, long vecs)                              \
    {                                                                                          \
        static const tile_fn_##S eight[] = {tile_##S##_8x1, tile_##S##_8x2, tile_##S##_8x3};   \
        static const tile_fn_##S six[] = {tile_##S##_6x1, tile_##S##_6x2, tile_##S##_6x3,      \
                                          tile_##S##_6x4};                                     \
        return g.rows == 8 ? eight[vecs - 1] : six[vecs - 1];                                  \
    }
#else
#define TILES(S, U, T)                                                                         \
    GEMM_TILE(S, U, T, 4, 1) GEMM_TILE(S, U, T, 4, 2) GEMM_TILE(S, U, T, 4, 3)                 \
    typedef void (*tile_fn_##S)(const U *const *, const uint32_t *, T *, const T *, long,      \
                                long, int, int);                                               \
    static tile_fn_##S tile_for_##S(struct geometry g, long vecs)                              \
    {                                                                                          \
        static const tile_fn_##S four[] = {tile_##S##_4x1, tile_##S##_4x2, tile_##S##_4x3};    \
        (void)g;                                                                               \
        return four[vecs - 1];                                                                 \
    }
#endif

#define GEMM(S, U, T)                                                                          \
    TILES(S, U, T)                                                                             \
                                                                                               \
    static void multiply_tiles_##S(const uint32_t *xp, const U *w, const T *b, T *y, long M,  \
                                   long N, long K, struct geometry g, long panel)              \
    {                                                                                          \
        long num_tiles = (N + g.rows - 1) / g.rows;                                            \
        _Pragma("omp for schedule(static)") for (long t = 0; t < num_tiles; t++)               \
        {                                                                                      \
            long n0 = t * g.rows;                                                              \
            int rows = N - n0 < g.rows ? (int)(N - n0) : g.rows;                               \
            const U *w_rows[MAX_ROWS]; /* past N: the last row again, computed and dropped */  \
            for (int i = 0; i < g.rows; i++) w_rows[i] = w + (n0 + (i < rows ? i : rows - 1)) * K; \
            for (long m0 = 0; m0 < M; m0 += panel) {                                           \
                long width = panel_width(m0, M, panel);                                        \
                int cols = (int)(M - m0 < width ? M - m0 : width);                             \
                tile_for_##S(g, width / LANES)(w_rows, xp + m0 * K, y + m0 * N + n0,           \
                                               b ? b + n0 : NULL, N, K, rows, cols);           \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static int gemm_##S(const uint32_t *x, const U *w, const T *b, T *y, long M, long N,      \
                        long K)                                                                \
    {                                                                                          \
        const struct geometry g = M > NARROW.vecs * LANES ? WIDE : NARROW;                     \
        const long panel = g.vecs * LANES, padded = (M + LANES - 1) / LANES * LANES;           \
        uint32_t *xp = aligned_alloc(64, (padded * K * sizeof(uint32_t) + 63) / 64 * 64);      \
        if (!xp)                                                                               \
            return 1;                                                                          \
        _Pragma("omp parallel")                                                                \
        {                                                                                      \
            pack_tokens(x, xp, M, K, panel);                                                   \
            _Pragma("omp barrier")                                                             \
            multiply_tiles_##S(xp, w, b, y, M, N, K, g, panel);                                \
        }                                                                                      \
        free(xp);                                                                              \
        return 0;                                                                              \
    }

GEMM(f32, float, float)

int v1e_gemm_f32(const float *x, const float *w, const float *b, float *y, long M, long N, long K)
{
    return gemm_f32((const uint32_t *)x, w, b, y, M, N, K);
}

#if defined(__AVX512BF16__)
GEMM(bf16, uint32_t, uint16_t)

/* K must be even (a unit is a pair along k); cpu_kernels.gemm checks it. */
int v1e_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, long M,
                  long N, long K)
{
    return gemm_bf16((const uint32_t *)x, (const uint32_t *)w, b, y, M, N, K / 2);
}
#endif
