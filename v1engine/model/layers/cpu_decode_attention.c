/* Decode attention on CPU: each sequence's one new query token over its keys in the paged cache,
   read in place through the block table (no gather, no padding, no mask tensor).

   One task per sequence. A cache row (one position's K or V for every KV head) is contiguous, so a
   task reads its keys block by block, each block one contiguous run of memory, and asks for the
   rows PREFETCH_AHEAD positions ahead before it needs them: the keys of a decode step come from
   DRAM (the weights streamed since the last step evicted them), and without the prefetch the
   reads wait on memory latency (about 2x slower here). Two passes over the visible keys: scores,
   their maximum and the softmax per query head, then the weighted sum of values, so the softmax
   is exact (no running rescale).

   The layout contract is attention_backend.py's: key position p of sequence s lives in block
   block_table[s, p / block_size] at offset p % block_size; the query sits at seq_lens[s] - 1 and
   sees positions > seq_lens[s] - 1 - window (all of them when window is 0). Query head h reads
   KV head h / (num_heads / num_kv_heads).

   q [S, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_table [S, table_stride]
   int32; seq_lens [S] int32, each >= 1; out [S, H, D]. Built with the other kernels into one
   library (cpu_kernel_library.py); returns nonzero if a score buffer could not be allocated. */

#include <math.h>
#include <stdlib.h>

#include "cpu_kernels.h"

#define PREFETCH_AHEAD 4

struct attention_shape {
    long num_heads, num_kv_heads, head_size, block_size, window;
    float scale;
};

/* Position `pos`'s cache row (KVH * D elements, `row_bytes` bytes), through the block table. */
static inline const char *row_at(const char *cache, const int32_t *table, long pos,
                                 long block_size, long row_bytes)
{
    return cache + ((long)table[pos / block_size] * block_size + pos % block_size) * row_bytes;
}

/* The i-th visible position's row (position first + i), having asked for the row PREFETCH_AHEAD
   positions later, which the caller reads next. */
static inline const void *row_ahead(const void *cache, const int32_t *table, long first, long i,
                                    long n, long block_size, long row_bytes)
{
    if (i + PREFETCH_AHEAD < n) {
        const char *next = row_at(cache, table, first + i + PREFETCH_AHEAD, block_size, row_bytes);
        for (long b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b);
    }
    return row_at(cache, table, first + i, block_size, row_bytes);
}

/* Per sequence: `_probabilities` turns the query and the visible keys into softmax weights
   (scores[h * n + i] for query head h and the i-th visible key), `_weighted_values` sums the
   values with them into the output. */
#define DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                 \
    static void NAME##_probabilities(const T *q, const T *k_cache, const int32_t *table,       \
                                     long first, long n, const struct attention_shape *sh,     \
                                     float *scores)                                            \
    {                                                                                          \
        const long H = sh->num_heads, D = sh->head_size, bs = sh->block_size;                  \
        const long G = H / sh->num_kv_heads, row = sh->num_kv_heads * D;                       \
        float qf[H][D], best[H];                                                               \
        for (long h = 0; h < H; h++) {                                                         \
            for (long d = 0; d < D; d++) qf[h][d] = LOAD(q[h * D + d]);                        \
            best[h] = -INFINITY;                                                               \
        }                                                                                      \
        for (long i = 0; i < n; i++) {                                                         \
            const T *key = row_ahead(k_cache, table, first, i, n, bs, row * sizeof(T));        \
            for (long h = 0; h < H; h++) {                                                     \
                const T *kh = key + (h / G) * D;                                               \
                float s = 0.f;                                                                 \
                _Pragma("omp simd reduction(+:s)")                                             \
                for (long d = 0; d < D; d++) s += qf[h][d] * LOAD(kh[d]);                      \
                scores[h * n + i] = s * sh->scale;                                             \
                if (scores[h * n + i] > best[h]) best[h] = scores[h * n + i];                  \
            }                                                                                  \
        }                                                                                      \
        for (long h = 0; h < H; h++) {                                                         \
            float total = 0.f, *p = scores + h * n, top = best[h];                             \
            _Pragma("omp simd reduction(+:total)")                                             \
            for (long i = 0; i < n; i++) total += p[i] = v1e_expf(p[i] - top);                 \
            for (long i = 0; i < n; i++) p[i] /= total;                                        \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static void NAME##_weighted_values(const T *v_cache, const int32_t *table, long first,     \
                                       long n, const struct attention_shape *sh,               \
                                       const float *probabilities, T *out)                     \
    {                                                                                          \
        const long H = sh->num_heads, D = sh->head_size, bs = sh->block_size;                  \
        const long G = H / sh->num_kv_heads, row = sh->num_kv_heads * D;                       \
        float acc[H][D];                                                                       \
        memset(acc, 0, sizeof acc);                                                            \
        for (long i = 0; i < n; i++) {                                                         \
            const T *value = row_ahead(v_cache, table, first, i, n, bs, row * sizeof(T));      \
            for (long h = 0; h < H; h++) {                                                     \
                const T *vh = value + (h / G) * D;                                             \
                float p = probabilities[h * n + i];                                            \
                _Pragma("omp simd")                                                            \
                for (long d = 0; d < D; d++) acc[h][d] += p * LOAD(vh[d]);                     \
            }                                                                                  \
        }                                                                                      \
        for (long h = 0; h < H; h++)                                                           \
            for (long d = 0; d < D; d++) out[h * D + d] = STORE(acc[h][d]);                    \
    }                                                                                          \
                                                                                               \
    static void NAME##_sequence(const T *q, const T *k_cache, const T *v_cache,                \
                                const int32_t *table, long seq_len, T *out,                    \
                                const struct attention_shape *sh, float *scores)               \
    {                                                                                          \
        const long first = sh->window > 0 && seq_len > sh->window ? seq_len - sh->window : 0;  \
        NAME##_probabilities(q, k_cache, table, first, seq_len - first, sh, scores);           \
        NAME##_weighted_values(v_cache, table, first, seq_len - first, sh, scores, out);       \
    }                                                                                          \
                                                                                               \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_table,      \
             const int32_t *seq_lens, T *out, long num_seqs, long num_heads,                   \
             long num_kv_heads, long head_size, long block_size, long table_stride,            \
             long window, float scale)                                                         \
    {                                                                                          \
        const struct attention_shape sh = {num_heads, num_kv_heads, head_size, block_size,     \
                                           window, scale};                                     \
        int failed = 0;                                                                        \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                       \
        for (long s = 0; s < num_seqs; s++) {                                                  \
            float *scores = malloc(sizeof(float) * num_heads * seq_lens[s]);                   \
            if (!scores) {                                                                     \
                failed = 1;                                                                    \
                continue;                                                                      \
            }                                                                                  \
            NAME##_sequence(q + s * num_heads * head_size, k_cache, v_cache,                   \
                            block_table + s * table_stride, seq_lens[s],                       \
                            out + s * num_heads * head_size, &sh, scores);                     \
            free(scores);                                                                      \
        }                                                                                      \
        return failed;                                                                         \
    }

DECODE_ATTENTION(v1e_decode_attention_f32, float, AS_FLOAT, AS_FLOAT)
DECODE_ATTENTION(v1e_decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Stores each new token's K and V row (KVH * D elements, `row_bytes` bytes) at its slot; rows of
   key/value are `key_stride`/`value_stride` bytes apart (a view into the fused QKV output). */
void v1e_write_kv(const char *key, const char *value, char *k_cache, char *v_cache,
                  const int64_t *slots, long num_tokens, long key_stride, long value_stride,
                  long row_bytes)
{
    for (long t = 0; t < num_tokens; t++) {
        memcpy(k_cache + slots[t] * row_bytes, key + t * key_stride, row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, value + t * value_stride, row_bytes);
    }
}
