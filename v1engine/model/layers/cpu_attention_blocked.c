/* The two passes of paged attention as small matrix products, for units with many query vectors:
   a prefill's rows times the query heads that share a KV head (AVX-512, head sizes 64, 128 and
   256).

   The per-key passes (cpu_paged_attention.c) take one query vector at a time: each key's dot
   product is LANES partial sums folded by a shuffle tree, and each value is loaded once per
   query vector, so a prefill's attention ran at a fifth to a quarter of the FMA peak (60-83
   GFLOP/s on one SmolLM2 layer, scripts/bench_attention.py). Here a group of 16 keys of one
   KV head is transposed once ([D][16], in L1) and every query vector of the unit that reads
   that KV head takes it: per dimension, one load of 16 keys and one broadcast of the query
   feed 16 scores, SCORE_BLOCK query vectors at a time, with no folding. The values pass keeps
   a few query vectors' sums in registers and loads each value row once for all of them.

   Same three passes and the same softmax as the per-key path (scores with -inf for keys a row
   does not see, e^(score - max), the sums scaled by 1 / total once); only the order of the
   additions inside a dot product differs (dimension by dimension, one chain). A key a row does
   not see has weight 0 in the values pass: every key of the unit is a written cache row (at
   most the unit's last position), so 0 times it adds nothing. */

#include <stdlib.h>

#include "cpu_attention.h"

#if LANES == 16

#define SCORE_BLOCK 12 /* query vectors per pass over a transposed key group */
#define MAX_HEAD 256

/* Whether the blocked passes take a unit of `rows` rows with G query heads per KV head: a head
   size they are built for, and enough query vectors to share each transposed key group (a
   decode's few do not repay the transposes), or a whole unit of a prompt's rows. With one query
   head per KV head those are 8 vectors in a block of 12, still 1.3-1.7x faster than the per-key
   passes on prompts of 144 to 1,024 tokens (bench_attention.py --shape 12,12,64 and 32,32,128:
   2.96 vs 3.74 ms for 13 prompts of 144 and 9.3 vs 12.2 for one of 1,024; 15.2 vs 23.8 and 57.6
   vs 84.3). */
static inline int blocked_passes_take(long rows, long G, long D)
{
    return (D == 64 || D == 128 || D == 256) && (rows * G >= SCORE_BLOCK || rows == ROW_BLOCK);
}

int v1e_attention_prefill_passes(long num_heads, long num_kv_heads, long head_size)
{
    const long G = num_heads / num_kv_heads;
    if (!blocked_passes_take(ROW_BLOCK, G, head_size)) return 0;
    return ROW_BLOCK * G >= SCORE_BLOCK ? 2 : 1;
}

/* The unit's query vectors that read one KV head g, i = 0 .. rows * G - 1: row i / G, query head
   g * G + i % G. Divided out once per unit (a division costs tens of cycles; a block of scores
   is a few hundred). */
struct query_vectors {
    long count, G;
    const long *row;    /* [count] */
    const long *offset; /* [count]: row * H + i % G, to which g * G is added */
};

/* Query vector min(i, count - 1) of KV head g: its index r * H + h among the unit's. */
static inline long query_index(const struct query_vectors *qv, long i, long g)
{
    i = i < qv->count ? i : qv->count - 1;
    return qv->offset[i] + g * qv->G;
}

/* The cache row of each of the unit's keys (first .. first + n - 1), from one walk through the
   block table: every pass over the keys (each KV head's key groups, each block of query vectors'
   values) reads it, where each walked the table again, and the values pass runs over all the
   keys without stopping at every 16 (NULL if it could not be allocated). */
static long *key_rows(const int32_t *table, const struct unit *u, long block_size)
{
    long *rows = malloc(sizeof *rows * (u->n > 0 ? u->n : 1));
    struct cursor at = cursor_at(u->first, block_size);
    for (long i = 0; rows && i < u->n; i++) {
        rows[i] = (long)table[at.block] * block_size + at.offset;
        if (++at.offset == block_size) at.offset = 0, at.block++;
    }
    return rows;
}

/* Lanes lo .. hi - 1 of 16 as a mask. */
static inline __mmask16 lanes(long lo, long hi)
{
    return hi > lo ? (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1)) : 0;
}

/* The scores of SCORE_BLOCK query vectors from q0 (the last one repeated past the count) over
   the transposed group kt [D][16], stored for the keys each one sees: `count` keys from i0. */
static void score_block(const float *qf, const float *kt, const struct unit *u,
                        const struct attention_shape *sh, const struct query_vectors *qv, long g,
                        long q0, long i0, long count, float *scores)
{
    const long D = sh->head_size, n = u->n;
    const float *query[SCORE_BLOCK];
    __m512 acc[SCORE_BLOCK];
    for (int b = 0; b < SCORE_BLOCK; b++) {
        query[b] = qf + query_index(qv, q0 + b, g) * D;
        acc[b] = _mm512_setzero_ps();
    }
    for (long d = 0; d < D; d++) {
        const __m512 keys = _mm512_load_ps(kt + d * 16);
        for (int b = 0; b < SCORE_BLOCK; b++)
            acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(query[b][d]), keys, acc[b]);
    }
    const __m512 hidden = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(sh->scale);
    for (long b = 0; b < SCORE_BLOCK && q0 + b < qv->count; b++) {
        long j0, j1;
        seen(u, qv->row[q0 + b], i0, count, &j0, &j1);
        __m512 s = _mm512_mask_blend_ps(lanes(j0, j1), hidden, _mm512_mul_ps(acc[b], scale));
        _mm512_mask_storeu_ps(scores + query_index(qv, q0 + b, g) * n + i0, lanes(0, count), s);
    }
}

/* The weighted values of B query vectors from q0 over the unit's keys, scaled by their inverse
   totals, into out; `_values_` does every block of KV head g. VECS vectors per head. */
#define VALUE_BLOCK(NAME, T, LOAD, STORE, VECS, B)                                             \
    static void NAME##_value_block_##VECS(const char *v_cache, const long *key_rows,           \
                                          const struct unit *u,                                \
                                          const struct attention_shape *sh,                    \
                                          const struct query_vectors *qv, long g, long q0,     \
                                          const float *weights, const float *inverse_totals,   \
                                          T *out)                                              \
    {                                                                                          \
        const long n = u->n;                                                                   \
        const long row_bytes = sh->num_kv_heads * VECS * 16 * sizeof(T);                       \
        const char *head = v_cache + g * VECS * 16 * sizeof(T);                                \
        const float *p[B];                                                                     \
        long rh[B];                                                                            \
        __m512 acc[B][VECS];                                                                   \
        for (int b = 0; b < B; b++) {                                                          \
            rh[b] = query_index(qv, q0 + b, g);                                                \
            p[b] = weights + rh[b] * n;                                                        \
            for (int c = 0; c < VECS; c++) acc[b][c] = _mm512_setzero_ps();                    \
        }                                                                                      \
        for (long j = 0; j < n; j++) {                                                         \
            const T *value = (const T *)(head + key_rows[j] * row_bytes);                      \
            __m512 v[VECS];                                                                    \
            for (int c = 0; c < VECS; c++) v[c] = (__m512)LOAD(value + c * 16);                \
            for (int b = 0; b < B; b++) {                                                      \
                const __m512 w = _mm512_set1_ps(p[b][j]);                                      \
                for (int c = 0; c < VECS; c++)                                                 \
                    acc[b][c] = _mm512_fmadd_ps(w, v[c], acc[b][c]);                           \
            }                                                                                  \
        }                                                                                      \
        for (long b = 0; b < B && q0 + b < qv->count; b++) {                                   \
            float sums[VECS * 16];                                                             \
            const __m512 inverse = _mm512_set1_ps(inverse_totals[rh[b]]);                      \
            for (int c = 0; c < VECS; c++)                                                     \
                _mm512_storeu_ps(sums + c * 16, _mm512_mul_ps(acc[b][c], inverse));            \
            for (long d = 0; d < VECS * 16; d++) out[rh[b] * VECS * 16 + d] = STORE(sums[d]);  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static void NAME##_values_##VECS(const char *v_cache, const long *key_rows,                \
                                     const struct unit *u, const struct attention_shape *sh,   \
                                     const struct query_vectors *qv, long g,                   \
                                     const float *weights, const float *inverse_totals, T *out) \
    {                                                                                          \
        for (long q0 = 0; q0 < qv->count; q0 += B)                                             \
            NAME##_value_block_##VECS(v_cache, key_rows, u, sh, qv, g, q0, weights,            \
                                      inverse_totals, out);                                    \
    }

/* LOAD: an element -> float; VECTOR_LOAD: 16 elements -> a vector; STORE: float -> element. */
#define BLOCKED_ATTENTION(NAME, T, LOAD, VECTOR_LOAD, STORE)                                   \
    VALUE_BLOCK(NAME, T, VECTOR_LOAD, STORE, 4, 6)                                             \
    VALUE_BLOCK(NAME, T, VECTOR_LOAD, STORE, 8, 3)                                             \
    VALUE_BLOCK(NAME, T, VECTOR_LOAD, STORE, 16, 1)                                            \
                                                                                               \
    /* The 16 keys at rows[], KV head g, as kt[d][16] (transposed 16 x 16 at a time). */       \
    static void NAME##_transposed_keys(const char *const *rows, long g, long D, float *kt)     \
    {                                                                                          \
        for (long c = 0; c < D / 16; c++) {                                                    \
            __m512 r[16];                                                                      \
            for (int j = 0; j < 16; j++)                                                       \
                r[j] = (__m512)VECTOR_LOAD((const T *)rows[j] + g * D + c * 16);               \
            transpose_16x16(r);                                                                \
            for (int d = 0; d < 16; d++) _mm512_store_ps(kt + (c * 16 + d) * 16, r[d]);        \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static void NAME##_scores(const float *qf, const char *k_cache, const long *key_rows,      \
                              const struct unit *u, const struct attention_shape *sh,          \
                              const struct query_vectors *qv, float *scores)                   \
    {                                                                                          \
        const long KVH = sh->num_kv_heads, D = sh->head_size, n = u->n;                        \
        const long row_bytes = KVH * D * sizeof(T);                                            \
        float kt[MAX_HEAD * 16] __attribute__((aligned(64)));                                  \
        const char *rows[16];                                                                  \
        for (long i0 = 0; i0 < n; i0 += 16) {                                                  \
            const long count = n - i0 < 16 ? n - i0 : 16;                                      \
            for (long j = 0; j < 16; j++)                                                      \
                rows[j] = k_cache + key_rows[i0 + (j < count ? j : count - 1)] * row_bytes;    \
            for (long g = 0; g < KVH; g++) {                                                   \
                NAME##_transposed_keys(rows, g, D, kt);                                        \
                for (long q0 = 0; q0 < qv->count; q0 += SCORE_BLOCK)                           \
                    score_block(qf, kt, u, sh, qv, g, q0, i0, count, scores);                  \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    int NAME(const T *q, const char *k_cache, const char *v_cache, const int32_t *table,       \
             const struct unit *u, const struct attention_shape *sh, float *scores, T *out)    \
    {                                                                                          \
        const long H = sh->num_heads, D = sh->head_size, G = H / sh->num_kv_heads;             \
        if (!blocked_passes_take(u->rows, G, D)) return 0;                                     \
        long row_of[u->rows * G], offset_of[u->rows * G];                                      \
        for (long i = 0; i < u->rows * G; i++) {                                               \
            row_of[i] = i / G;                                                                 \
            offset_of[i] = row_of[i] * H + i % G;                                              \
        }                                                                                      \
        const struct query_vectors qv = {u->rows * G, G, row_of, offset_of};                   \
        long *rows = key_rows(table, u, sh->block_size);                                       \
        if (!rows) return 0;                                                                   \
        float qf[u->rows * H * D];                                                             \
        for (long i = 0; i < u->rows * H * D; i++) qf[i] = LOAD(q[i]);                         \
        NAME##_scores(qf, k_cache, rows, u, sh, &qv, scores);                                  \
        float inverse_totals[u->rows * H];                                                     \
        softmax(scores, u->rows * H, u->n, sh->soft_cap, inverse_totals);                      \
        for (long g = 0; g < sh->num_kv_heads; g++) {                                          \
            if (D == 64)                                                                       \
                NAME##_values_4(v_cache, rows, u, sh, &qv, g, scores, inverse_totals, out);    \
            else if (D == 128)                                                                 \
                NAME##_values_8(v_cache, rows, u, sh, &qv, g, scores, inverse_totals, out);    \
            else                                                                               \
                NAME##_values_16(v_cache, rows, u, sh, &qv, g, scores, inverse_totals, out);   \
        }                                                                                      \
        free(rows);                                                                            \
        return 1;                                                                              \
    }

BLOCKED_ATTENTION(v1e_attention_blocked_f32, float, AS_FLOAT, load_f32, AS_FLOAT)
BLOCKED_ATTENTION(v1e_attention_blocked_bf16, uint16_t, bf16_to_f32, load_bf16, f32_to_bf16)

#else /* no AVX-512: the per-key passes take every unit */

int v1e_attention_prefill_passes(long num_heads, long num_kv_heads, long head_size)
{
    return 0;
}

int v1e_attention_blocked_f32(const float *q, const char *k_cache, const char *v_cache,
                              const int32_t *table, const struct unit *u,
                              const struct attention_shape *sh, float *scores, float *out)
{
    return 0;
}

int v1e_attention_blocked_bf16(const uint16_t *q, const char *k_cache, const char *v_cache,
                               const int32_t *table, const struct unit *u,
                               const struct attention_shape *sh, float *scores, uint16_t *out)
{
    return 0;
}

#endif
