/* RMSNorm with the residual add before it, in one pass per row (torch runs it as six kernels, each
   a dispatch and a sweep over the row, which at decode sizes costs more than the arithmetic).

   The arithmetic is layernorm.py's (HF's): sum = x + residual in the model dtype (stored, for the
   next layer's add), statistics in float32, the normalized row cast to the model dtype, then
   times the weight, rounded to the model dtype. x, residual, sum, out: [rows, hidden]; residual
   and sum may be NULL (no add); weight [hidden]. Built into one library by
   cpu_kernel_library.py. */

#include <math.h>

#include "cpu_kernels.h"

#define RMS_NORM(NAME, T, LOAD, STORE)                                                         \
    void NAME(const T *x, const T *residual, const T *weight, T *sum, T *out, long rows,       \
              long hidden, float eps)                                                          \
    {                                                                                          \
        _Pragma("omp parallel for if (rows >= 64)")                                            \
        for (long r = 0; r < rows; r++) {                                                      \
            const T *xr = x + r * hidden;                                                      \
            T *sr = sum ? sum + r * hidden : 0;                                                \
            if (residual) {                                                                    \
                const T *rr = residual + r * hidden;                                           \
                for (long i = 0; i < hidden; i++) sr[i] = STORE(LOAD(xr[i]) + LOAD(rr[i]));    \
                xr = sr;                                                                       \
            }                                                                                  \
            float squares = 0.f;                                                               \
            _Pragma("omp simd reduction(+:squares)")                                           \
            for (long i = 0; i < hidden; i++) squares += LOAD(xr[i]) * LOAD(xr[i]);            \
            float inv = 1.f / sqrtf(squares / hidden + eps);                                   \
            T *o = out + r * hidden;                                                           \
            for (long i = 0; i < hidden; i++)                                                  \
                o[i] = STORE(LOAD(weight[i]) * LOAD(STORE(LOAD(xr[i]) * inv)));                \
        }                                                                                      \
    }

RMS_NORM(v1e_rms_norm_f32, float, AS_FLOAT, AS_FLOAT)
RMS_NORM(v1e_rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
