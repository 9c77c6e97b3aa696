/* y[m, :] = x[m, :] W^T (+ b) for a handful of tokens m: the matmul of a CPU decode step.

   With one to a few tokens a linear layer is a stream over its weights: each weight is read once
   and used by one multiply-add per token, so the memory bandwidth sets its speed. GEMM libraries
   tile and pack for many tokens and reach half of that bandwidth or less at these sizes; this loop
   reads each weight row once, in order, for up to four tokens at a time (four independent sums, so
   the adds do not wait on each other), and comes near it (scripts/bench_gemm.py measures both).

   Compiled by cpu_kernel_library.py with -O3 -march=native -fopenmp. `omp simd reduction` lets
   the compiler reorder each dot product into vector lanes without -ffast-math (which, in a shared
   object built by GCC 12, would switch the whole process to flush-to-zero). The OpenMP runtime is
   the libgomp torch has already loaded, so these threads are torch's intra-op threads and
   torch.set_num_threads sizes them. Weights and activations are row-major and contiguous:
   x [M, K], w [N, K], b [N] or NULL, y [M, N]; M is small (cpu_kernels.max_gemv_tokens). */

#include "cpu_kernels.h"

#define TOKEN_TILE 4

/* Below this many weights (256 KiB of float32) one thread reads them in about what starting and
   joining a parallel region costs, and far less where another process holds a core the region
   has to wait for (the LM-head screen's few candidate rows, greedy_screen.py). */
#define PARALLEL_MIN_WEIGHTS (1L << 16)

/* How many rows ahead a thread prefetches its weights: about 4 KiB, for rows of up to 4 KiB. The
   hardware's stream prefetcher stops at every 4 KiB page boundary, which a short row (SmolLM2's
   576 floats: 2304 bytes) crosses every other row; long rows keep it going, and there a software
   prefetch was slower. Same bits; at one token a SmolLM2 step's matmuls ran 8-10% faster with
   2 rows ahead than without, 5% with 4, 3% with 8 (alternating same-run A/Bs, weights from memory). */
static long prefetch_rows(long row_bytes)
{
    return row_bytes > 4096 ? 0 : (4096 + row_bytes - 1) / row_bytes;
}

/* One weight row against every token, TOKEN_TILE tokens per pass over the row, then the exported
   y = x W^T (+ b). `LOAD` turns an element into a float, `STORE` a float into an element; sums are
   float32 (as oneDNN and torch accumulate), rounded once on store. */
#define GEMV(NAME, T, LOAD, STORE)                                                            \
    static void NAME##_row(const T *restrict x, const T *restrict wr, float *sums, long M,    \
                           long K)                                                            \
    {                                                                                         \
        long m = 0;                                                                           \
        for (; m + TOKEN_TILE <= M; m += TOKEN_TILE) {                                        \
            const T *x0 = x + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;                \
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;                                     \
            _Pragma("omp simd reduction(+:s0,s1,s2,s3)")                                      \
            for (long k = 0; k < K; k++) {                                                    \
                float wk = LOAD(wr[k]);                                                       \
                s0 += LOAD(x0[k]) * wk; s1 += LOAD(x1[k]) * wk;                               \
                s2 += LOAD(x2[k]) * wk; s3 += LOAD(x3[k]) * wk;                               \
            }                                                                                 \
            sums[m] = s0; sums[m + 1] = s1; sums[m + 2] = s2; sums[m + 3] = s3;               \
        }                                                                                     \
        for (; m < M; m++) {                                                                  \
            const T *xm = x + m * K;                                                          \
            float s = 0.f;                                                                    \
            _Pragma("omp simd reduction(+:s)")                                                \
            for (long k = 0; k < K; k++) s += LOAD(xm[k]) * LOAD(wr[k]);                      \
            sums[m] = s;                                                                      \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    void NAME(const T *x, const T *w, const T *b, T *y, long M, long N, long K)               \
    {                                                                                         \
        const long ahead = prefetch_rows(K * (long)sizeof(T));                                \
        _Pragma("omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)")       \
        for (long n = 0; n < N; n++) {                                                        \
            float sums[M];                                                                    \
            if (ahead && n + ahead < N)                                                       \
                for (long l = 0; l < K; l += 64 / (long)sizeof(T))                            \
                    __builtin_prefetch(w + (n + ahead) * K + l);                              \
            NAME##_row(x, w + n * K, sums, M, K);                                             \
            float bias = b ? LOAD(b[n]) : 0.f;                                                \
            for (long m = 0; m < M; m++) y[m * N + n] = STORE(sums[m] + bias);                \
        }                                                                                     \
    }

GEMV(v1e_gemv_f32, float, AS_FLOAT, AS_FLOAT)
GEMV(v1e_gemv_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
