/* Paged attention on CPU, for any step: each sequence's new query rows (one for a decode, many for
   a prefill or a chunk of one) over its keys in the paged cache, read in place through the block
   table (no gather, no padding, no mask tensor).

   The work is cut into units of up to ROW_BLOCK consecutive query rows of one sequence, one task
   each. A unit makes three passes over the keys its rows see: the scores of every row and query
   head (keys a row does not see score -inf), an exact softmax per row and head (its maximum
   first, no running rescale), then the weighted sum of the values, divided by the softmax's
   total once at the end. Each key row is read once per pass for all the unit's rows and heads,
   so a prefill's keys come from memory once per ROW_BLOCK rows, not once per row. Positions are
   walked LANES at a time (16 with AVX-512, 8 otherwise), block by block.

   Head sizes of 1 to 8 or 16 whole vectors (every real model's: 64, 128, and with AVX-512 also
   Gemma's 256) take the vector path: for each row and query head, LANES keys' dot products are
   summed across their lanes by one shuffle tree into one vector of LANES scores, instead of one
   horizontal sum per key; the values are summed two keys at a time into vector accumulators.
   Other head sizes (tiny test models; 256 with AVX2) take a plain loop per key. Units with enough query vectors per KV head (a prefill's rows) take the
   blocked passes of cpu_attention_blocked.c instead, on AVX-512 CPUs, for head sizes 64 and 128.

   The layout contract is attention_backend.py's: key position p of sequence s lives in block
   block_table[s, p / block_size] at offset p % block_size; sequence s's query rows are
   query_start_loc[s] .. query_start_loc[s + 1] - 1, its last tokens, so row i sits at position
   seq_lens[s] - q_len + i and sees positions k <= it, and with a window W > 0 only those with
   position - k < W. Query head h reads KV head h / (num_heads / num_kv_heads).

   q [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_table [S, table_stride]
   int32; seq_lens [S] int32; query_start_loc [S + 1] int32, or NULL for one row per sequence (a
   step of decodes: T = S); out [T, H, D]. Built with the other kernels into one library
   (cpu_kernel_library.py); returns nonzero if a buffer could not be allocated. */

#include <stdlib.h>

#include "cpu_attention.h"

/* The vector path for head_size = VECS * LANES: `_scores` fills scores[(r * H + h) * n + i]
   (row r, query head h, key first + i), `_values` sums the values with the softmax weights and
   scales the sums by the inverse totals. */
#define VECTOR_PASSES(NAME, T, LOAD, STORE, VECS)                                              \
    static void NAME##_scores_##VECS(const T *q, const char *k_cache, const char *v_cache,    \
                                     const int32_t *table,                                     \
                                     const struct unit *u, const struct attention_shape *sh,   \
                                     float *scores)                                            \
    {                                                                                          \
        const long H = sh->num_heads, n = u->n;                                                \
        const long row_bytes = sh->num_kv_heads * VECS * LANES * sizeof(T);                    \
        const long *head_of = sh->head_offset;                                                 \
        vec query[u->rows * H][VECS];                                                          \
        for (long rh = 0; rh < u->rows * H; rh++)                                              \
            for (int c = 0; c < VECS; c++) query[rh][c] = LOAD(q + (rh * VECS + c) * LANES);    \
        const char *rows[LANES];                                                               \
        const struct cursor first = cursor_at(u->first, sh->block_size);                      \
        struct cursor at = first;                                                              \
        for (long i0 = 0; i0 < n; i0 += LANES) {                                               \
            long count = n - i0 < LANES ? n - i0 : LANES;                                      \
            group_rows(rows, k_cache, table, &at, count, sh->block_size, row_bytes);           \
            /* the next keys, or after the last ones the first values */                      \
            struct pending pf =                                                                \
                i0 + count < n                                                                 \
                    ? pending_group(k_cache, table, &at, n - i0 - count, sh->block_size,       \
                                    row_bytes, u->rows * H)                                    \
                    : pending_group(v_cache, table, &first, n, sh->block_size, row_bytes,      \
                                    u->rows * H);                                              \
            for (long r = 0; r < u->rows; r++) {                                               \
                long j0, j1;                                                                   \
                seen(u, r, i0, count, &j0, &j1);                                               \
                for (long h = 0; h < H; h++) {                                                 \
                    prefetch_slice(&pf);                                                       \
                    float *s = scores + (r * H + h) * n + i0;                                  \
                    for (long j = 0; j < count; j++) s[j] = -INFINITY;                         \
                    if (j1 <= j0) continue;                                                    \
                    const vec *qh = query[r * H + h];                                          \
                    vec dots[LANES];                                                           \
                    _Pragma("GCC unroll 16") for (int j = 0; j < LANES; j++) {                 \
                        const T *key = (const T *)rows[j] + head_of[h];                        \
                        vec dot = qh[0] * LOAD(key);                                           \
                        _Pragma("GCC unroll 8") for (int c = 1; c < VECS; c++)                 \
                            dot += qh[c] * LOAD(key + c * LANES);                              \
                        dots[j] = dot;                                                         \
                    }                                                                          \
                    vec sums = sum_lanes(dots) * sh->scale;                                    \
                    for (long j = j0; j < j1; j++) s[j] = sums[j];                             \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* Not inlined: in the task's body its inner loop spilled the row pointers to the stack. */ \
    static __attribute__((noinline)) void NAME##_values_##VECS(                                \
        const char *v_cache, const int32_t *table, const struct unit *u,                       \
        const struct attention_shape *sh, const float *weights, const float *inverse_totals,   \
        T *out)                                                                                \
    {                                                                                          \
        const long H = sh->num_heads, n = u->n;                                                \
        const long row_bytes = sh->num_kv_heads * VECS * LANES * sizeof(T);                    \
        const long *head_of = sh->head_offset;                                                 \
        vec acc[u->rows * H][VECS];                                                            \
        memset(acc, 0, sizeof acc);                                                            \
        const char *rows[LANES];                                                               \
        struct cursor at = cursor_at(u->first, sh->block_size);                                \
        for (long i0 = 0; i0 < n; i0 += LANES) {                                               \
            long count = n - i0 < LANES ? n - i0 : LANES;                                      \
            group_rows(rows, v_cache, table, &at, count, sh->block_size, row_bytes);           \
            struct pending pf = pending_group(v_cache, table, &at, n - i0 - count,             \
                                              sh->block_size, row_bytes, u->rows * H);         \
            for (long r = 0; r < u->rows; r++) {                                               \
                long j0, j, j1;                                                                \
                seen(u, r, i0, count, &j0, &j1);                                               \
                for (long h = 0; h < H; h++) {                                                 \
                    prefetch_slice(&pf);                                                       \
                    const long rh = r * H + h, head = head_of[h];                              \
                    const float *p = weights + rh * n + i0;                                    \
                    vec even[VECS], odd[VECS]; /* two keys at a time: two chains of adds */    \
                    _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++) {                   \
                        even[c] = acc[rh][c];                                                  \
                        odd[c] = (vec){0};                                                     \
                    }                                                                          \
                    for (j = j0; j + 1 < j1; j += 2) {                                         \
                        const T *a = (const T *)rows[j] + head;                                \
                        const T *b = (const T *)rows[j + 1] + head;                            \
                        _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++) {               \
                            even[c] += p[j] * LOAD(a + c * LANES);                             \
                            odd[c] += p[j + 1] * LOAD(b + c * LANES);                          \
                        }                                                                      \
                    }                                                                          \
                    if (j < j1)                                                                \
                        _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++)                 \
                            even[c] += p[j] * LOAD((const T *)rows[j] + head + c * LANES);     \
                    _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++)                     \
                        acc[rh][c] = even[c] + odd[c];                                         \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (long rh = 0; rh < u->rows * H; rh++)                                              \
            for (int c = 0; c < VECS; c++)                                                     \
                for (int l = 0; l < LANES; l++)                                                \
                    out[(rh * VECS + c) * LANES + l] =                                         \
                        STORE(acc[rh][c][l] * inverse_totals[rh]);                             \
    }

/* The plain path, any head size, in one walk over the keys per pass: with `acc` NULL it fills
   scores[(r * H + h) * n + i], else it adds the probabilities there times key i's value to
   acc[r * H + h] (acc: [rows, H, D] floats, zeroed). */
#define PLAIN_PASS(NAME, T, LOAD)                                                              \
    static void NAME##_plain_pass(const T *q, const char *cache, const int32_t *table,         \
                                  const struct unit *u, const struct attention_shape *sh,      \
                                  float *scores, float *acc)                                   \
    {                                                                                          \
        const long H = sh->num_heads, D = sh->head_size, n = u->n;                             \
        const long row_bytes = sh->num_kv_heads * D * sizeof(T);                               \
        const char *rows[LANES];                                                               \
        struct cursor at = cursor_at(u->first, sh->block_size);                                \
        for (long i0 = 0; i0 < n; i0 += LANES) {                                               \
            long count = n - i0 < LANES ? n - i0 : LANES;                                      \
            group_rows(rows, cache, table, &at, count, sh->block_size, row_bytes);             \
            for (long rh = 0; rh < u->rows * H; rh++) {                                        \
                long j0, j1;                                                                   \
                seen(u, rh / H, i0, count, &j0, &j1);                                          \
                float *score = scores + rh * n + i0;                                           \
                for (long j = 0; j < count; j++) {                                             \
                    const T *head = (const T *)rows[j] + sh->head_offset[rh % H];              \
                    if (acc) {                                                                 \
                        if (j < j0 || j >= j1) continue;                                       \
                        for (long d = 0; d < D; d++) acc[rh * D + d] += score[j] * LOAD(head[d]); \
                        continue;                                                              \
                    }                                                                          \
                    float dot = 0.f;                                                           \
                    for (long d = 0; d < D; d++) dot += LOAD(q[rh * D + d]) * LOAD(head[d]);   \
                    score[j] = j >= j0 && j < j1 ? dot * sh->scale : -INFINITY;                \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

/* One unit: scores, softmax, values, by the vector path when the head size allows. */
#define VECTOR_CASE(NAME, VECS)                                                                \
    case VECS:                                                                                 \
        NAME##_scores_##VECS(q, k_cache, v_cache, table, u, sh, scores);                       \
        softmax(scores, u->rows * sh->num_heads, u->n, sh->soft_cap, inverse_totals);          \
        NAME##_values_##VECS(v_cache, table, u, sh, scores, inverse_totals, out);              \
        return 0;

#define PAGED_ATTENTION(NAME, T, LOAD, VECTOR_LOAD, STORE, BLOCKED)                            \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 1)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 2)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 3)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 4)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 5)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 6)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 7)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 8)                                              \
    VECTOR_PASSES(NAME, T, VECTOR_LOAD, STORE, 16)                                             \
    PLAIN_PASS(NAME, T, LOAD)                                                                  \
                                                                                               \
    static int NAME##_unit(const T *q, const char *k_cache, const char *v_cache,               \
                           const int32_t *table, const struct unit *u, T *out,                 \
                           const struct attention_shape *sh, float *scores)                    \
    {                                                                                          \
        if (BLOCKED(q, k_cache, v_cache, table, u, sh, scores, out)) return 0;                 \
        float inverse_totals[u->rows * sh->num_heads];                                         \
        switch (sh->head_size % LANES == 0 ? sh->head_size / LANES : 0) {                      \
            VECTOR_CASE(NAME, 1)                                                               \
            VECTOR_CASE(NAME, 2)                                                               \
            VECTOR_CASE(NAME, 3)                                                               \
            VECTOR_CASE(NAME, 4)                                                               \
            VECTOR_CASE(NAME, 5)                                                               \
            VECTOR_CASE(NAME, 6)                                                               \
            VECTOR_CASE(NAME, 7)                                                               \
            VECTOR_CASE(NAME, 8)                                                               \
            VECTOR_CASE(NAME, 16)                                                              \
        }                                                                                      \
        const long size = u->rows * sh->num_heads * sh->head_size;                             \
        float *acc = calloc(size, sizeof(float));                                              \
        if (!acc) return 1;                                                                    \
        NAME##_plain_pass(q, k_cache, table, u, sh, scores, NULL);                             \
        softmax(scores, u->rows * sh->num_heads, u->n, sh->soft_cap, inverse_totals);          \
        NAME##_plain_pass(q, v_cache, table, u, sh, scores, acc);                              \
        for (long i = 0; i < size; i++)                                                        \
            out[i] = STORE(acc[i] * inverse_totals[i / sh->head_size]);                        \
        free(acc);                                                                             \
        return 0;                                                                              \
    }                                                                                          \
                                                                                               \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_table,       \
             const int32_t *seq_lens, const int32_t *query_start_loc, T *out, long num_seqs,   \
             long num_heads, long num_kv_heads, long head_size, long block_size,               \
             long table_stride, long window, float scale, float soft_cap)                      \
    {                                                                                          \
        long head_offset[num_heads];                                                           \
        for (long h = 0; h < num_heads; h++)                                                   \
            head_offset[h] = h / (num_heads / num_kv_heads) * head_size;                       \
        const struct attention_shape sh = {num_heads, num_kv_heads, head_size, block_size,     \
                                           window, scale, soft_cap, head_offset};              \
        long num_units;                                                                        \
        long *units = plan_units(query_start_loc, num_seqs, &num_units);                       \
        if (!units) return 1;                                                                  \
        const long row_size = num_heads * head_size;                                           \
        int failed = 0;                                                                        \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                       \
        for (long i = 0; i < num_units; i++) {                                                 \
            const long s = units[2 * i], row0 = units[2 * i + 1];                              \
            struct unit u;                                                                     \
            describe_unit(&u, seq_lens[s], query_start_loc, s, row0, window);                  \
            float *scores = malloc(sizeof(float) * u.rows * num_heads * u.n);                  \
            if (!scores ||                                                                     \
                NAME##_unit(q + row0 * row_size, (const char *)k_cache, (const char *)v_cache, \
                            block_table + s * table_stride, &u, out + row0 * row_size, &sh,    \
                            scores))                                                           \
                failed = 1;                                                                    \
            free(scores);                                                                      \
        }                                                                                      \
        free(units);                                                                           \
        return failed;                                                                         \
    }

/* Sequence s's query rows: start .. end - 1 of the step's rows. */
static void query_rows(const int32_t *query_start_loc, long s, long *start, long *end)
{
    *start = query_start_loc ? query_start_loc[s] : s;
    *end = query_start_loc ? query_start_loc[s + 1] : s + 1;
}

/* The work units as (sequence, first row) pairs, ROW_BLOCK rows apart; *num_units of them. */
static long *plan_units(const int32_t *query_start_loc, long num_seqs, long *num_units)
{
    long total = 0, start, end;
    for (long s = 0; s < num_seqs; s++) {
        query_rows(query_start_loc, s, &start, &end);
        total += (end - start + ROW_BLOCK - 1) / ROW_BLOCK;
    }
    long *units = malloc(sizeof(long) * 2 * (total ? total : 1)), i = 0;
    for (long s = 0; units && s < num_seqs; s++) {
        query_rows(query_start_loc, s, &start, &end);
        for (long row = start; row < end; row += ROW_BLOCK, i++) {
            units[2 * i] = s;
            units[2 * i + 1] = row;
        }
    }
    *num_units = total;
    return units;
}

/* The unit of sequence s starting at step row row0: its rows' positions and the keys they see. */
static void describe_unit(struct unit *u, long seq_len, const int32_t *query_start_loc, long s,
                          long row0, long window)
{
    long start, end;
    query_rows(query_start_loc, s, &start, &end);
    u->rows = end - row0 < ROW_BLOCK ? end - row0 : ROW_BLOCK;
    const long pos0 = seq_len - (end - start) + (row0 - start); /* the first row's position */
    u->first = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;
    u->n = pos0 + u->rows - u->first;
    for (long r = 0; r < u->rows; r++) {
        const long pos = pos0 + r;
        u->hi[r] = pos - u->first;
        u->lo[r] = (window > 0 && pos + 1 > window ? pos + 1 - window : 0) - u->first;
    }
}

PAGED_ATTENTION(v1e_paged_attention_f32, float, AS_FLOAT, load_f32, AS_FLOAT,
                v1e_attention_blocked_f32)
PAGED_ATTENTION(v1e_paged_attention_bf16, uint16_t, bf16_to_f32, load_bf16, f32_to_bf16,
                v1e_attention_blocked_bf16)

/* Stores each new token's K and V row (KVH * D elements, `row_bytes` bytes) at its slot; rows of
   key/value are `key_stride`/`value_stride` bytes apart (a view into the fused QKV output).
   Split over the threads from 64 tokens, as the norms are: the first write into a cache page
   takes a page fault that zero-fills it (the cache is mapped lazily, kv_cache.py), and the
   threads take theirs at once. A 2,048-token step's 30 layers of SmolLM2 K/V, in a one-off C
   harness: 34-37 ms on one thread into fresh pages against 19 on two, 5.4 against 3.5 ms into
   pages already touched. */
void v1e_write_kv(const char *key, const char *value, char *k_cache, char *v_cache,
                  const int64_t *slots, long num_tokens, long key_stride, long value_stride,
                  long row_bytes)
{
#pragma omp parallel for if (num_tokens >= 64)
    for (long t = 0; t < num_tokens; t++) {
        memcpy(k_cache + slots[t] * row_bytes, key + t * key_stride, row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, value + t * value_stride, row_bytes);
    }
}
