/* y[m, :] = x[m, :] W^T (+ b) for a handful of tokens m: the matmul of a CPU decode step.

   With one to a few tokens a linear layer is a stream over its weights: each weight is read once
   and used by one multiply-add per token, so the memory bandwidth sets its speed. GEMM libraries
   tile and pack for many tokens and reach half of that bandwidth or less at these sizes; this loop
   reads each weight row once, in order, for up to four tokens at a time (four independent sums, so
   the adds do not wait on each other), and comes near it (scripts/bench_gemm.py measures both).

   Compiled by cpu_kernels.py with -O3 -march=native -fopenmp. `omp simd reduction` lets the compiler
   reorder each dot product into vector lanes without -ffast-math (which, in a shared object built
   by GCC 12, would switch the whole process to flush-to-zero). The OpenMP runtime is the libgomp
   torch has already loaded, so these threads are torch's intra-op threads and
   torch.set_num_threads sizes them. Weights and activations are row-major and contiguous:
   x [M, K], w [N, K], b [N] or NULL, y [M, N]. */

#include "cpu_kernels.h"

#define TOKEN_TILE 4

/* One weight row against every token, TOKEN_TILE tokens per pass over the row. `LOAD` turns an
   element of x or w into a float; `sums` gets one dot product per token. */
#define DOT_ROW(T, LOAD)                                                                  \
    static void dot_row_##T(const T *restrict x, const T *restrict wr, float *sums,       \
                            long M, long K)                                               \
    {                                                                                     \
        long m = 0;                                                                       \
        for (; m + TOKEN_TILE <= M; m += TOKEN_TILE) {                                    \
            const T *x0 = x + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;            \
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;                                 \
            _Pragma("omp simd reduction(+:s0,s1,s2,s3)")                                  \
            for (long k = 0; k < K; k++) {                                                \
                float wk = LOAD(wr[k]);                                                   \
                s0 += LOAD(x0[k]) * wk; s1 += LOAD(x1[k]) * wk;                           \
                s2 += LOAD(x2[k]) * wk; s3 += LOAD(x3[k]) * wk;                           \
            }                                                                             \
            sums[m] = s0; sums[m + 1] = s1; sums[m + 2] = s2; sums[m + 3] = s3;           \
        }                                                                                 \
        for (; m < M; m++) {                                                              \
            const T *xm = x + m * K;                                                      \
            float s = 0.f;                                                                \
            _Pragma("omp simd reduction(+:s)")                                            \
            for (long k = 0; k < K; k++) s += LOAD(xm[k]) * LOAD(wr[k]);                  \
            sums[m] = s;                                                                  \
        }                                                                                 \
    }

DOT_ROW(float, AS_FLOAT)
DOT_ROW(uint16_t, bf16_to_f32)

void v1e_gemv_f32(const float *x, const float *w, const float *b, float *y,
                  long M, long N, long K)
{
    #pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        float sums[M];
        dot_row_float(x, w + n * K, sums, M, K);
        float bias = b ? b[n] : 0.f;
        for (long m = 0; m < M; m++) y[m * N + n] = sums[m] + bias;
    }
}

/* bfloat16 in and out, float32 sums (as oneDNN and torch accumulate). */
void v1e_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y,
                   long M, long N, long K)
{
    #pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        float sums[M];
        dot_row_uint16_t(x, w + n * K, sums, M, K);
        float bias = b ? bf16_to_f32(b[n]) : 0.f;
        for (long m = 0; m < M; m++) y[m * N + n] = f32_to_bf16(sums[m] + bias);
    }
}
