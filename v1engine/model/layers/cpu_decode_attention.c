/* Decode attention on CPU: each sequence's one new query token over its keys in the paged cache,
   read in place through the block table (no gather, no padding, no mask tensor).

   One task per sequence, three passes over its visible keys: the scores of every query head, an
   exact softmax per head (its maximum first, no running rescale), then the probability-weighted
   sum of the values. A cache row (one position's K or V for every KV head) is contiguous, and
   positions are walked LANES at a time (16 with AVX-512, 8 otherwise), block by block.

   Head sizes that are whole vectors (every real model's: 64, 128, ...) take the vector path: for
   each query head, LANES keys' dot products are summed across their lanes by one shuffle tree
   into one vector of LANES scores, instead of one horizontal sum per key; the values are summed
   two keys at a time into vector accumulators. Both passes read each key's row while it is in
   cache for every query head. Other head sizes (tiny test models) take a plain loop per key.

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

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define MAX_HEAD_VECS 8 /* the vector path takes head sizes up to 8 * LANES */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef uint16_t bf16_vec_unaligned __attribute__((vector_size(LANES * 2), aligned(2)));
typedef int32_t int_vec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec load_f32(const float *p) { return *(const vec_unaligned *)p; }

static inline vec load_bf16(const uint16_t *p)
{
    int_vec bits = __builtin_convertvector(*(const bf16_vec_unaligned *)p, int_vec) << 16;
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

struct attention_shape {
    long num_heads, num_kv_heads, head_size, block_size, window;
    float scale;
};

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

/* The cache rows of `count` (<= LANES) positions from `pos` on, walking the block table block by
   block; slots past `count` repeat the last row, so that a partial group reads valid memory. */
static inline void group_rows(const char **rows, const char *cache, const int32_t *table, long pos,
                              long count, long block_size, long row_bytes)
{
    long block = pos / block_size, offset = pos % block_size;
    const char *base = cache + (long)table[block] * block_size * row_bytes;
    for (long j = 0; j < count; j++) {
        rows[j] = base + offset * row_bytes;
        if (++offset == block_size && j + 1 < count) {
            offset = 0;
            base = cache + (long)table[++block] * block_size * row_bytes;
        }
    }
    for (long j = count; j < LANES; j++) rows[j] = rows[count - 1];
}

/* scores [H, n] -> softmax per head, in place. */
static void softmax(float *scores, long num_heads, long n)
{
    for (long h = 0; h < num_heads; h++) {
        float *p = scores + h * n, top = -INFINITY, total = 0.f;
        for (long i = 0; i < n; i++) top = p[i] > top ? p[i] : top;
        _Pragma("omp simd reduction(+:total)")
        for (long i = 0; i < n; i++) total += p[i] = v1e_expf(p[i] - top);
        for (long i = 0; i < n; i++) p[i] /= total;
    }
}

/* The vector path for head_size = VECS * LANES: `_scores` fills scores[h * n + i] (query head h,
   the i-th visible key), `_values` sums the values with the softmax weights into out. */
#define VECTOR_PASSES(NAME, T, LOAD, STORE, VECS)                                               \
    static void NAME##_scores_##VECS(const T *q, const char *k_cache, const int32_t *table,     \
                                     long first, long n, const struct attention_shape *sh,     \
                                     float *scores)                                            \
    {                                                                                          \
        const long H = sh->num_heads, G = H / sh->num_kv_heads;                                \
        const long row_bytes = sh->num_kv_heads * VECS * LANES * sizeof(T);                    \
        vec query[H][VECS];                                                                    \
        for (long h = 0; h < H; h++)                                                           \
            for (int c = 0; c < VECS; c++) query[h][c] = LOAD(q + (h * VECS + c) * LANES);      \
        const char *rows[LANES];                                                               \
        for (long i0 = 0; i0 < n; i0 += LANES) {                                               \
            long count = n - i0 < LANES ? n - i0 : LANES;                                      \
            group_rows(rows, k_cache, table, first + i0, count, sh->block_size, row_bytes);    \
            for (long h = 0; h < H; h++) {                                                     \
                const long head = (h / G) * VECS * LANES;                                      \
                vec dots[LANES];                                                               \
                _Pragma("GCC unroll 16") for (int j = 0; j < LANES; j++) {                     \
                    const T *key = (const T *)rows[j] + head;                                  \
                    vec dot = query[h][0] * LOAD(key);                                         \
                    _Pragma("GCC unroll 8") for (int c = 1; c < VECS; c++)                     \
                        dot += query[h][c] * LOAD(key + c * LANES);                            \
                    dots[j] = dot;                                                             \
                }                                                                              \
                vec sums = sum_lanes(dots) * sh->scale;                                        \
                for (long j = 0; j < count; j++) scores[h * n + i0 + j] = sums[j];             \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static void NAME##_values_##VECS(const char *v_cache, const int32_t *table, long first,    \
                                     long n, const struct attention_shape *sh,                 \
                                     const float *probabilities, T *out)                       \
    {                                                                                          \
        const long H = sh->num_heads, G = H / sh->num_kv_heads;                                \
        const long row_bytes = sh->num_kv_heads * VECS * LANES * sizeof(T);                    \
        vec acc[H][VECS];                                                                      \
        memset(acc, 0, sizeof acc);                                                            \
        const char *rows[LANES];                                                               \
        for (long i0 = 0; i0 < n; i0 += LANES) {                                               \
            long count = n - i0 < LANES ? n - i0 : LANES;                                      \
            group_rows(rows, v_cache, table, first + i0, count, sh->block_size, row_bytes);    \
            for (long h = 0; h < H; h++) {                                                     \
                const long head = (h / G) * VECS * LANES;                                      \
                const float *p = probabilities + h * n + i0;                                   \
                vec even[VECS], odd[VECS]; /* two keys at a time: two chains of adds */        \
                _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++) {                       \
                    even[c] = acc[h][c];                                                       \
                    odd[c] = (vec){0};                                                         \
                }                                                                              \
                long j = 0;                                                                    \
                for (; j + 1 < count; j += 2) {                                                \
                    const T *a = (const T *)rows[j] + head, *b = (const T *)rows[j + 1] + head; \
                    _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++) {                   \
                        even[c] += p[j] * LOAD(a + c * LANES);                                 \
                        odd[c] += p[j + 1] * LOAD(b + c * LANES);                              \
                    }                                                                          \
                }                                                                              \
                if (j < count)                                                                 \
                    _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++)                     \
                        even[c] += p[j] * LOAD((const T *)rows[j] + head + c * LANES);         \
                _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++)                         \
                    acc[h][c] = even[c] + odd[c];                                              \
            }                                                                                  \
        }                                                                                      \
        for (long h = 0; h < H; h++)                                                           \
            for (int c = 0; c < VECS; c++)                                                     \
                for (int l = 0; l < LANES; l++)                                                \
                    out[(h * VECS + c) * LANES + l] = STORE(acc[h][c][l]);                     \
    }

/* The plain path, any head size, in one walk over the visible keys per pass: with `acc` NULL it
   fills scores[h * n + i] (query head h, key i), else it adds probabilities[h * n + i] times
   key i's value to acc[h] (acc: [H, D] floats). */
#define PLAIN_PASS(NAME, T, LOAD)                                                              \
    static void NAME##_plain_pass(const T *q, const char *cache, const int32_t *table,         \
                                  long first, long n, const struct attention_shape *sh,        \
                                  float *scores, float *acc)                                   \
    {                                                                                          \
        const long H = sh->num_heads, D = sh->head_size, G = H / sh->num_kv_heads;             \
        const long row_bytes = sh->num_kv_heads * D * sizeof(T);                               \
        const char *rows[LANES];                                                               \
        for (long i0 = 0; i0 < n; i0 += LANES) {                                               \
            long count = n - i0 < LANES ? n - i0 : LANES;                                      \
            group_rows(rows, cache, table, first + i0, count, sh->block_size, row_bytes);      \
            for (long j = 0; j < count; j++)                                                   \
                for (long h = 0; h < H; h++) {                                                 \
                    const T *head = (const T *)rows[j] + (h / G) * D;                          \
                    float *score = scores + h * n + i0 + j;                                    \
                    if (acc) {                                                                 \
                        for (long d = 0; d < D; d++) acc[h * D + d] += *score * LOAD(head[d]); \
                        continue;                                                              \
                    }                                                                          \
                    float dot = 0.f;                                                           \
                    for (long d = 0; d < D; d++) dot += LOAD(q[h * D + d]) * LOAD(head[d]);    \
                    *score = dot * sh->scale;                                                  \
                }                                                                              \
        }                                                                                      \
    }

/* One sequence: scores, softmax, values, by the vector path when the head size allows. */
#define VECTOR_CASE(NAME, VECS)                                                                \
    case VECS:                                                                                 \
        NAME##_scores_##VECS(q, k_cache, table, first, n, sh, scores);                         \
        softmax(scores, sh->num_heads, n);                                                     \
        NAME##_values_##VECS(v_cache, table, first, n, sh, scores, out);                       \
        return;

#define DECODE_ATTENTION(NAME, T, LOAD, VECTOR_LOAD, STORE)                                    \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 1)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 2)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 3)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 4)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 5)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 6)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 7)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 8)                                              \
    PLAIN_PASS(NAME, T, LOAD)                                                                  \
                                                                                               \
    static void NAME##_sequence(const T *q, const char *k_cache, const char *v_cache,          \
                                const int32_t *table, long seq_len, T *out,                    \
                                const struct attention_shape *sh, float *scores)               \
    {                                                                                          \
        const long first = sh->window > 0 && seq_len > sh->window ? seq_len - sh->window : 0;  \
        const long n = seq_len - first;                                                        \
        switch (sh->head_size % LANES == 0 ? sh->head_size / LANES : 0) {                      \
            VECTOR_CASE(NAME, 1)                                                               \
            VECTOR_CASE(NAME, 2)                                                               \
            VECTOR_CASE(NAME, 3)                                                               \
            VECTOR_CASE(NAME, 4)                                                               \
            VECTOR_CASE(NAME, 5)                                                               \
            VECTOR_CASE(NAME, 6)                                                               \
            VECTOR_CASE(NAME, 7)                                                               \
            VECTOR_CASE(NAME, 8)                                                               \
        }                                                                                      \
        float acc[sh->num_heads * sh->head_size];                                              \
        memset(acc, 0, sizeof acc);                                                            \
        NAME##_plain_pass(q, k_cache, table, first, n, sh, scores, NULL);                      \
        softmax(scores, sh->num_heads, n);                                                     \
        NAME##_plain_pass(q, v_cache, table, first, n, sh, scores, acc);                       \
        for (long i = 0; i < sh->num_heads * sh->head_size; i++) out[i] = STORE(acc[i]);       \
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
            NAME##_sequence(q + s * num_heads * head_size, (const char *)k_cache,              \
                            (const char *)v_cache, block_table + s * table_stride,             \
                            seq_lens[s], out + s * num_heads * head_size, &sh, scores);        \
            free(scores);                                                                      \
        }                                                                                      \
        return failed;                                                                         \
    }

DECODE_ATTENTION(v1e_decode_attention_f32, float, AS_FLOAT, load_f32, AS_FLOAT)
DECODE_ATTENTION(v1e_decode_attention_bf16, uint16_t, bf16_to_f32, load_bf16, f32_to_bf16)

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
