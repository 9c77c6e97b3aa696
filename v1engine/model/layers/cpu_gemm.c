/* y[m, :] = x[m, :] W^T (+ b) for a batch of a few dozen tokens: the matmul of a CPU decode step
   with more requests than the kernel on packed weights takes (cpu_gemm_packed.c), float32, and of
   any step on a layer without packed weights.

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

/* ROWS outputs (weight rows `w`, of which `rows` are real) for the `cols` tokens of one panel
   of VECS vectors; xp is the panel, y the tile's top-left output. */
#define GEMM_TILE(ROWS, VECS)                                                                  \
    static void tile_##ROWS##x##VECS(const float *const *w, const float *restrict xp,          \
                                     float *y, const float *bias, long N, long K, int rows,    \
                                     int cols)                                                 \
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
                float weight = w[i][k];                                                        \
                _Pragma("GCC unroll 4") for (int c = 0; c < VECS; c++)                         \
                    acc[i][c] += weight * tokens[c];                                           \
            }                                                                                  \
        }                                                                                      \
        float out[ROWS][VECS * LANES];                                                         \
        _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++)                                 \
            _Pragma("GCC unroll 4") for (int c = 0; c < VECS; c++)                             \
                *(vec_unaligned *)&out[i][c * LANES] = acc[i][c];                              \
        for (int j = 0; j < cols; j++)                                                         \
            for (int i = 0; i < rows; i++) y[j * N + i] = out[i][j] + (bias ? bias[i] : 0.f);  \
    }

#if LANES == 16
GEMM_TILE(8, 1)
GEMM_TILE(8, 2)
GEMM_TILE(8, 3)
GEMM_TILE(6, 1)
GEMM_TILE(6, 2)
GEMM_TILE(6, 3)
GEMM_TILE(6, 4)
#else
GEMM_TILE(4, 1)
GEMM_TILE(4, 2)
GEMM_TILE(4, 3)
#endif

typedef void (*tile_fn)(const float *const *, const float *, float *, const float *, long, long,
                        int, int);

/* The tile for `vecs` vectors of tokens in geometry g's rows. */
static tile_fn tile_for(struct geometry g, long vecs)
{
#if LANES == 16
    static const tile_fn eight[] = {tile_8x1, tile_8x2, tile_8x3}, six[] = {tile_6x1, tile_6x2,
                                                                           tile_6x3, tile_6x4};
    return g.rows == 8 ? eight[vecs - 1] : six[vecs - 1];
#else
    static const tile_fn four[] = {tile_4x1, tile_4x2, tile_4x3};
    (void)g;
    return four[vecs - 1];
#endif
}

/* Tokens m0.. go in a panel of `panel`, or of the fewest whole vectors that hold the rest. */
static long panel_width(long m0, long M, long panel)
{
    long rest = M - m0;
    return rest >= panel ? panel : (rest + LANES - 1) / LANES * LANES;
}

#if LANES == 16
/* 16 tokens from x (rows `real` and past: zeros) x k0..k1 (at most 16) -> dst[k][16], row stride
   `width` floats. */
static void pack_block(const float *x, float *dst, long K, long real, long k0, long k1, long width)
{
    __m512 r[16];
    const __mmask16 mask = (__mmask16)((1u << (k1 - k0)) - 1);
    for (int j = 0; j < 16; j++)
        r[j] = j < real ? _mm512_maskz_loadu_ps(mask, x + j * K + k0) : _mm512_setzero_ps();
    transpose_16x16(r);
    for (long k = k0; k < k1; k++) _mm512_store_ps(dst + k * width, r[k - k0]);
}
#endif

/* x [M, K] -> one [K][width] panel per panel_width, zero padded, 16 tokens x 16 k at a time.
   Called inside the parallel region: the threads share the chunks of k. */
static void pack_tokens(const float *x, float *xp, long M, long K, long panel)
{
    for (long m0 = 0; m0 < M; m0 += panel) {
        long width = panel_width(m0, M, panel), real = M - m0 < width ? M - m0 : width;
        float *dst = xp + m0 * K;
#pragma omp for schedule(static) nowait
        for (long k0 = 0; k0 < K; k0 += 16) {
            long k1 = k0 + 16 < K ? k0 + 16 : K;
#if LANES == 16
            for (long j0 = 0; j0 < width; j0 += 16)
                pack_block(x + (m0 + j0) * K, dst + j0, K, real - j0, k0, k1, width);
#else
            for (long j = 0; j < width; j++)
                for (long k = k0; k < k1; k++)
                    dst[k * width + j] = j < real ? x[(m0 + j) * K + k] : 0.f;
#endif
        }
    }
}

/* This thread's share of the tiles: every panel of tokens times `rows` weight rows at a time. */
static void multiply_tiles(const float *xp, const float *w, const float *b, float *y, long M,
                           long N, long K, struct geometry g, long panel)
{
    long num_tiles = (N + g.rows - 1) / g.rows;
#pragma omp for schedule(static)
    for (long t = 0; t < num_tiles; t++) {
        long n0 = t * g.rows;
        int rows = N - n0 < g.rows ? (int)(N - n0) : g.rows;
        const float *w_rows[MAX_ROWS]; /* past N: the last row again, computed and dropped */
        for (int i = 0; i < g.rows; i++) w_rows[i] = w + (n0 + (i < rows ? i : rows - 1)) * K;
        for (long m0 = 0; m0 < M; m0 += panel) {
            long width = panel_width(m0, M, panel);
            int cols = (int)(M - m0 < width ? M - m0 : width);
            tile_for(g, width / LANES)(w_rows, xp + m0 * K, y + m0 * N + n0, b ? b + n0 : NULL,
                                       N, K, rows, cols);
        }
    }
}

int v1e_gemm_f32(const float *x, const float *w, const float *b, float *y, long M, long N, long K)
{
    const struct geometry g = M > NARROW.vecs * LANES ? WIDE : NARROW;
    const long panel = g.vecs * LANES, padded = (M + LANES - 1) / LANES * LANES;
    float *xp = aligned_alloc(64, (padded * K * sizeof(float) + 63) / 64 * 64);
    if (!xp)
        return 1;
#pragma omp parallel
    {
        pack_tokens(x, xp, M, K, panel);
#pragma omp barrier
        multiply_tiles(xp, w, b, y, M, N, K, g, panel);
    }
    free(xp);
    return 0;
}
