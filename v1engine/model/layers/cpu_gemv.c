/* y[m, :] = x[m, :] W^T (+ b) for a handful of tokens m: the matmul of a CPU decode step.

   With one to a few tokens a linear layer is a stream over its weights: each weight is read once
   and used by one multiply-add per token, so the memory bandwidth sets its speed. GEMM libraries
   tile and pack for many tokens and reach half of that bandwidth or less at these sizes; this loop
   reads each weight row once, in order, for up to four tokens at a time, and comes near it
   (scripts/bench_gemm.py measures both).

   Compiled by cpu_kernel_library.py with -O3 -march=native -fopenmp, without -ffast-math (which,
   in a shared object built by GCC 12, would switch the whole process to flush-to-zero): the sums'
   order is the one written here. The OpenMP runtime is the libgomp torch has already loaded, so
   these threads are torch's intra-op threads and torch.set_num_threads sizes them. Weights and
   activations are row-major and contiguous: x [M, K], w [N, K], b [N] or NULL, y [M, N]; M is
   small (cpu_kernels.max_gemv_tokens). */

#include <stdlib.h>

#include "cpu_vectors.h"

#define TOKEN_TILE 4

/* Each token's dot product with a row is split over ACCUMULATORS vector sums: sum j takes the
   row's vectors j, j + ACCUMULATORS, ... (the few past the last whole group go to sums 0, 1, 2).
   A multiply-add waits ~4 cycles for the one before it into the same sum, so more sums keep more
   of them in flight. Together with widening bfloat16 activations once per call, it made the
   bfloat16 step's matmuls 1.13-1.20x faster at 2-4 tokens and beat oneDNN at 5 (bench_gemm
   --baseline-ref, 2-core Zen 5); at one token they were level, float32 too (bench_decode:
   1.00x). Every token's sums are taken in this order whichever tile it is in, so a row's output
   has the same bits at any M. Measured with AVX-512 only; with AVX2's 16 vector registers a
   four-token tile's 16 sums do not all fit. */
#define ACCUMULATORS 4
#define GROUP (ACCUMULATORS * LANES)

/* Below this many weights (256 KiB of float32) one thread reads them in about what starting and
   joining a parallel region costs, and far less where another process holds a core the region
   has to wait for (the LM-head screen's few candidate rows, greedy_screen.py). */
#define PARALLEL_MIN_WEIGHTS (1L << 16)

/* How many rows ahead a thread prefetches its weights: about 4 KiB, for rows of up to 4 KiB. The
   hardware's stream prefetcher stops at every 4 KiB page boundary, which a short row (SmolLM2's
   576 floats: 2304 bytes) crosses every other row; long rows keep it going, and there a software
   prefetch was slower. At one token a SmolLM2 step's matmuls ran 8-10% faster with 2 rows ahead
   than without, 5% with 4, 3% with 8 (alternating same-run A/Bs, weights from memory). */
static long prefetch_rows(long row_bytes)
{
    return row_bytes > 4096 ? 0 : (4096 + row_bytes - 1) / row_bytes;
}

/* A token's sum: its vector sums added in pairs, their lanes by `sum_halving`, then the last
   K % LANES products (k from `tail`). */
#define FINISH_SUM(S, T, LOAD)                                                                 \
    static inline float finish_sum_##S(const vec *acc, const float *x, const T *w, long tail,  \
                                       long K)                                                 \
    {                                                                                          \
        float s = sum_halving((acc[0] + acc[1]) + (acc[2] + acc[3]));                          \
        for (long k = tail; k < K; k++) s += x[k] * LOAD(w[k]);                                \
        return s;                                                                              \
    }

/* sums[t] = x[t] . w for `tokens` tokens (a constant where it is inlined, so that the sums stay
   in registers): one pass over the weight row for them all. */
#define DOT_TOKENS(S, T)                                                                       \
    static inline __attribute__((always_inline)) void dot_tokens_##S(                          \
        const float *restrict x, const T *restrict w, float *sums, long K, const int tokens)   \
    {                                                                                          \
        vec acc[TOKEN_TILE][ACCUMULATORS] = {{{0}}};                                           \
        long k = 0;                                                                            \
        for (; k + GROUP <= K; k += GROUP)                                                     \
            for (int j = 0; j < ACCUMULATORS; j++) {                                           \
                vec wk = load_##S(w + k + j * LANES);                                          \
                for (int t = 0; t < tokens; t++)                                               \
                    acc[t][j] += load_f32(x + t * K + k + j * LANES) * wk;                     \
            }                                                                                  \
        for (int j = 0; k + LANES <= K; k += LANES, j++) {                                     \
            vec wk = load_##S(w + k);                                                          \
            for (int t = 0; t < tokens; t++) acc[t][j] += load_f32(x + t * K + k) * wk;        \
        }                                                                                      \
        for (int t = 0; t < tokens; t++) sums[t] = finish_sum_##S(acc[t], x + t * K, w, k, K); \
    }

/* y = x W^T (+ b) from float32 activations xf [M, K]; `LOAD` turns an element into a float,
   `STORE` rounds a float to one. */
#define GEMV_ROWS(S, T, LOAD, STORE)                                                           \
    static void gemv_rows_##S(const float *xf, const T *w, const T *b, T *y, long M, long N,  \
                              long K)                                                          \
    {                                                                                          \
        const long ahead = prefetch_rows(K * (long)sizeof(T));                                 \
        _Pragma("omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)")        \
        for (long n = 0; n < N; n++) {                                                         \
            const T *wr = w + n * K;                                                           \
            float sums[M];                                                                     \
            if (ahead && n + ahead < N)                                                        \
                for (long l = 0; l < K; l += 64 / (long)sizeof(T))                             \
                    __builtin_prefetch(w + (n + ahead) * K + l);                               \
            long m = 0;                                                                        \
            for (; m + TOKEN_TILE <= M; m += TOKEN_TILE)                                       \
                dot_tokens_##S(xf + m * K, wr, sums + m, K, TOKEN_TILE);                       \
            for (; m < M; m++) dot_tokens_##S(xf + m * K, wr, sums + m, K, 1);                 \
            float bias = b ? LOAD(b[n]) : 0.f;                                                 \
            for (m = 0; m < M; m++) y[m * N + n] = STORE(sums[m] + bias);                      \
        }                                                                                      \
    }

#define GEMV(S, T, LOAD, STORE)                                                                \
    FINISH_SUM(S, T, LOAD)                                                                     \
    DOT_TOKENS(S, T)                                                                           \
    GEMV_ROWS(S, T, LOAD, STORE)

GEMV(f32, float, AS_FLOAT, AS_FLOAT)
GEMV(bf16, uint16_t, bf16_to_f32, f32_to_bf16)

int v1e_gemv_f32(const float *x, const float *w, const float *b, float *y, long M, long N, long K)
{
    gemv_rows_f32(x, w, b, y, M, N, K);
    return 0;
}

/* The activations are widened to float32 once, not once per weight row; nonzero if that copy
   could not be allocated. */
int v1e_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, long M,
                  long N, long K)
{
    float *xf = malloc(sizeof *xf * (M * K > 0 ? M * K : 1));
    if (!xf) return 1;
    for (long i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
    gemv_rows_bf16(xf, w, b, y, M, N, K);
    free(xf);
    return 0;
}
