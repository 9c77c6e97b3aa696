/* y[m, :] = x[m, :] W^T (+ b) for the rows of a small CPU decode step (past the gemv's one row,
   up to cpu_kernels.max_gemm_packed_tokens), float32, on weights packed once at load time.

   A decode step reads every weight from memory once, and at a few tokens does a few FMAs per
   weight, too few to hide that read behind arithmetic unless the weights stream in order and
   arrive ahead of use. GEMM libraries pack the weights on every call; the tiled kernel
   (cpu_gemm.c) keeps nn.Linear's layout and streams 6 or 8 weight rows at a time. Here the
   packing is done once, by v1e_pack_weight_f32, into panels of PANEL = 3 vectors of outputs,
   k-major:

       wp[p][k][j] = W[p * PANEL + j, k]        (zero past N)

   so that one aligned vector load gives one k for LANES outputs, and a panel is one contiguous
   stream. A task takes one panel and, for each block of up to ROWS tokens, accumulates

       acc[i][v] += x[m + i, k] * wp[p][k][v * LANES .. v * LANES + LANES - 1]    k = 0 .. K-1

   in ROWS x 3 vector registers: per k, 3 loads of weights and ROWS broadcasts of tokens (read in
   place from x's rows, which stay in cache) feed ROWS * 3 FMAs, and the results are whole vectors
   of y's row. The first block reads the panel from memory, the others from L2; meanwhile every
   block prefetches its share of the next panel, so that no block waits on memory. In SmolLM2's
   decode steps (scripts/profile_steps.py, decoder stack per step, same window) this took 38-39
   ms against 50-52 for the gemv and tiled kernels at 8 requests, 43 vs 45-47 at 16, 54-62 vs
   59-65 at 24 and 70 vs 74-83 at 32, but 99-113 vs 87-88 at 48 and 152-157 vs 131-135 at 64:
   past 32 rows each weight panel is re-read from L2 once per block of 8 tokens, where the tiled
   kernel reads each weight once per 48 or 64 tokens. linear.py takes each kernel where it wins.

   Every output is one float32 multiply-add chain in k order, as in the tiled kernel, so the two
   give the same bits, and a row's result does not depend on how many rows share the call.
   Compiled with the other kernels (cpu_kernel_library.py: -O3 -march=native -fopenmp); 16 lanes
   and blocks of 8 tokens with AVX-512, 8 lanes and blocks of 4 otherwise (the accumulators, the
   weights and a broadcast must fit the vector registers). x [M, K], b [N] or NULL, y [M, N], all
   row-major and contiguous; wp as packed, 64-byte aligned. */

#include "cpu_vectors.h"

#define VECS 3
#define PANEL (VECS * LANES)
#if LANES == 16
#define ROWS 8
#else
#define ROWS 4
#endif

#define LINE_FLOATS 16 /* floats per 64-byte cache line, the unit of a prefetch */

long v1e_gemm_panel_width(void) { return PANEL; }

void v1e_pack_weight_f32(const float *w, float *wp, long N, long K)
{
    const long panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++)
        for (long k = 0; k < K; k++)
            for (long j = 0; j < PANEL; j++) {
                const long n = p * PANEL + j;
                wp[(p * K + k) * PANEL + j] = n < N ? w[n * K + k] : 0.f;
            }
}

/* What one block of tokens prefetches of the next panel: `lines` cache lines from `from`,
   `per_k` of them per k. */
struct prefetch {
    const float *from;
    long lines;
    int per_k;
};

/* R tokens (x's rows, y's rows) times one panel; `width` of its outputs are real. */
#define GEMM_TILE(R)                                                                           \
    static void tile_##R(const float *restrict wp, const float *restrict x, float *y,          \
                         const float *bias, long N, long K, int width, struct prefetch pf)     \
    {                                                                                          \
        vec acc[R][VECS];                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)                                    \
            _Pragma("GCC unroll 3") for (int v = 0; v < VECS; v++) acc[i][v] = (vec){0};       \
        for (long k = 0; k < K; k++) {                                                         \
            for (int q = 0; q < pf.per_k; q++)                                                 \
                if (k * pf.per_k + q < pf.lines)                                               \
                    __builtin_prefetch(pf.from + (k * pf.per_k + q) * LINE_FLOATS, 0, 2);      \
            vec weights[VECS];                                                                 \
            _Pragma("GCC unroll 3") for (int v = 0; v < VECS; v++)                             \
                weights[v] = *(const vec *)(wp + k * PANEL + v * LANES);                       \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                              \
                float token = x[i * K + k];                                                    \
                _Pragma("GCC unroll 3") for (int v = 0; v < VECS; v++)                         \
                    acc[i][v] += token * weights[v];                                           \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < R; i++)                                                            \
            store_row(acc[i], y + i * N, bias, width);                                         \
    }

/* One token's PANEL outputs (+ bias) into y; only `width` of them past the last full panel. */
static inline void store_row(const vec *acc, float *y, const float *bias, int width)
{
    for (int v = 0; v < VECS; v++) {
        vec out = acc[v];
        if (width >= (v + 1) * LANES) {
            if (bias)
                out += load_f32(bias + v * LANES);
            *(vec_unaligned *)(y + v * LANES) = out;
        } else {
            for (int j = 0; j < width - v * LANES; j++)
                y[v * LANES + j] = out[j] + (bias ? bias[v * LANES + j] : 0.f);
        }
    }
}

#if ROWS == 8
GEMM_TILE(1) GEMM_TILE(2) GEMM_TILE(3) GEMM_TILE(4) GEMM_TILE(5) GEMM_TILE(6) GEMM_TILE(7)
GEMM_TILE(8)
typedef void (*tile_fn)(const float *, const float *, float *, const float *, long, long, int,
                        struct prefetch);
static const tile_fn TILES[ROWS + 1] = {0,      tile_1, tile_2, tile_3, tile_4,
                                        tile_5, tile_6, tile_7, tile_8};
#else
GEMM_TILE(1) GEMM_TILE(2) GEMM_TILE(3) GEMM_TILE(4)
typedef void (*tile_fn)(const float *, const float *, float *, const float *, long, long, int,
                        struct prefetch);
static const tile_fn TILES[ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4};
#endif

/* Block `block` of `blocks` takes an equal share of the next panel's lines (none after the
   last panel), spread over its K steps. */
static struct prefetch share_of_next(const float *next, long lines, long block, long blocks,
                                     long K)
{
    const long share = (lines + blocks - 1) / blocks;
    const long first = block * share < lines ? block * share : lines;
    const long count = lines - first < share ? lines - first : share;
    return (struct prefetch){next + first * LINE_FLOATS, count,
                             (int)((share + K - 1) / K)};
}

void v1e_gemm_packed_f32(const float *x, const float *wp, const float *b, float *y, long M,
                         long N, long K)
{
    const long panels = (N + PANEL - 1) / PANEL, blocks = (M + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++) {
        const long n0 = p * PANEL;
        const int width = N - n0 < PANEL ? (int)(N - n0) : PANEL;
        const float *panel = wp + p * K * PANEL;
        const long next_lines = p + 1 < panels ? K * PANEL / LINE_FLOATS : 0;
        for (long block = 0; block < blocks; block++) {
            const long m0 = block * ROWS;
            const int rows = M - m0 < ROWS ? (int)(M - m0) : ROWS;
            TILES[rows](panel, x + m0 * K, y + m0 * N + n0, b ? b + n0 : NULL, N, K, width,
                        share_of_next(panel + K * PANEL, next_lines, block, blocks, K));
        }
    }
}
