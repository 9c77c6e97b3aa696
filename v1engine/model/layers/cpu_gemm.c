/* y[m, :] = x[m, :] W^T (+ b) for a batch of a few dozen tokens: the matmul of a CPU decode step
   with more requests than the gemv takes (cpu_gemv.c), float32.

   At 9 to 64 tokens GEMM libraries are at their weakest (oneDNN and MKL ran 90-130 GFLOP/s here
   where they reach 200-250 on prefills; scripts/bench_gemm.py), while each weight is still read
   from memory once per step. This kernel keeps the weights in nn.Linear's layout and copies the
   tokens instead: x is packed once per call into panels of up to PANEL_VECS * LANES tokens,
   k-major ([K][panel width], zero padded), so that one vector load gives one k for 16 tokens.
   Each task takes TILE_ROWS weight rows (outputs) and, for every panel, accumulates

       acc[i][c] += W[n + i, k] * xp[k][c * LANES .. c * LANES + LANES - 1]     for k = 0 .. K-1

   in TILE_ROWS x PANEL_VECS vector registers: per k, TILE_ROWS broadcasts of a weight and
   PANEL_VECS loads of tokens feed TILE_ROWS * PANEL_VECS fused multiply-adds (8 + 3 loads per 24
   FMAs with AVX-512), and each weight row is streamed once per panel, prefetched ahead. The
   tile is then transposed into y. Every output is one float32 multiply-add chain in k order, so a
   row's result does not depend on which other rows share the call.

   Compiled with the other kernels (cpu_kernel_library.py: -O3 -march=native -fopenmp); the vector
   width follows the ISA (16 lanes with AVX-512, 8 otherwise, with fewer rows to fit 16
   registers). x [M, K], w [N, K], b [N] or NULL, y [M, N], all row-major and contiguous. Returns
   nonzero if the packed copy of x could not be allocated. */

#include <stdlib.h>

#include "cpu_vectors.h"

#if LANES == 16
#define TILE_ROWS 8
#else
#define TILE_ROWS 4
#endif
#define PANEL_VECS 3
#define PANEL (PANEL_VECS * LANES)
#define PREFETCH_FLOATS 64 /* how far ahead of k each weight row is asked for */

/* TILE_ROWS outputs (weight rows `w`, of which `rows` are real) for the `cols` tokens of one
   panel of VECS vectors; xp is the panel, y the tile's top-left output. */
#define GEMM_TILE(VECS)                                                                        \
    static void tile_##VECS(const float *const *w, const float *restrict xp, float *y,         \
                            const float *bias, long N, long K, int rows, int cols)             \
    {                                                                                          \
        vec acc[TILE_ROWS][VECS];                                                              \
        _Pragma("GCC unroll 8") for (int i = 0; i < TILE_ROWS; i++)                            \
            _Pragma("GCC unroll 3") for (int c = 0; c < VECS; c++) acc[i][c] = (vec){0};       \
        for (long k = 0; k < K; k++) {                                                         \
            if (k % 16 == 0)                                                                   \
                _Pragma("GCC unroll 8") for (int i = 0; i < TILE_ROWS; i++)                    \
                    __builtin_prefetch(w[i] + k + PREFETCH_FLOATS);                            \
            vec tokens[VECS];                                                                  \
            _Pragma("GCC unroll 3") for (int c = 0; c < VECS; c++)                             \
                tokens[c] = *(const vec *)(xp + k * VECS * LANES + c * LANES);                 \
            _Pragma("GCC unroll 8") for (int i = 0; i < TILE_ROWS; i++) {                      \
                float weight = w[i][k];                                                        \
                _Pragma("GCC unroll 3") for (int c = 0; c < VECS; c++)                         \
                    acc[i][c] += weight * tokens[c];                                           \
            }                                                                                  \
        }                                                                                      \
        float out[TILE_ROWS][VECS * LANES];                                                    \
        _Pragma("GCC unroll 8") for (int i = 0; i < TILE_ROWS; i++)                            \
            _Pragma("GCC unroll 3") for (int c = 0; c < VECS; c++)                             \
                *(vec_unaligned *)&out[i][c * LANES] = acc[i][c];                              \
        for (int j = 0; j < cols; j++)                                                         \
            for (int i = 0; i < rows; i++) y[j * N + i] = out[i][j] + (bias ? bias[i] : 0.f);  \
    }

GEMM_TILE(1)
GEMM_TILE(2)
GEMM_TILE(3)

/* Tokens m0.. go in a panel of PANEL, or of the fewest whole vectors that hold the rest. */
static long panel_width(long m0, long M)
{
    long rest = M - m0;
    return rest >= PANEL ? PANEL : (rest + LANES - 1) / LANES * LANES;
}

/* x [M, K] -> one [K][width] panel per panel_width, zero padded; copied 16 k at a time so that
   each cache line of x is read whole (rows K floats apart can share a handful of cache sets). */
static void pack_tokens(const float *x, float *xp, long M, long K)
{
    for (long m0 = 0; m0 < M; m0 += PANEL) {
        long width = panel_width(m0, M), real = M - m0 < width ? M - m0 : width;
        float *panel = xp + m0 * K;
        for (long k0 = 0; k0 < K; k0 += 16) {
            long k1 = k0 + 16 < K ? k0 + 16 : K;
            for (long j = 0; j < width; j++)
                for (long k = k0; k < k1; k++)
                    panel[k * width + j] = j < real ? x[(m0 + j) * K + k] : 0.f;
        }
    }
}

static void gemm_tile(const float *const *w, const float *xp, float *y, const float *bias,
                      long N, long K, int rows, int cols, long width)
{
    if (width == 3 * LANES)
        tile_3(w, xp, y, bias, N, K, rows, cols);
    else if (width == 2 * LANES)
        tile_2(w, xp, y, bias, N, K, rows, cols);
    else
        tile_1(w, xp, y, bias, N, K, rows, cols);
}

int v1e_gemm_f32(const float *x, const float *w, const float *b, float *y, long M, long N, long K)
{
    long padded = (M + LANES - 1) / LANES * LANES;
    float *xp = aligned_alloc(64, (padded * K * sizeof(float) + 63) / 64 * 64);
    if (!xp)
        return 1;
    pack_tokens(x, xp, M, K);
    long num_tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < num_tiles; t++) {
        long n0 = t * TILE_ROWS;
        int rows = N - n0 < TILE_ROWS ? (int)(N - n0) : TILE_ROWS;
        const float *w_rows[TILE_ROWS]; /* past N: the last row again, computed and dropped */
        for (int i = 0; i < TILE_ROWS; i++) w_rows[i] = w + (n0 + (i < rows ? i : rows - 1)) * K;
        for (long m0 = 0; m0 < M; m0 += PANEL) {
            long width = panel_width(m0, M);
            int cols = (int)(M - m0 < width ? M - m0 : width);
            gemm_tile(w_rows, xp + m0 * K, y + m0 * N + n0, b ? b + n0 : NULL, N, K, rows, cols,
                      width);
        }
    }
    free(xp);
    return 0;
}
