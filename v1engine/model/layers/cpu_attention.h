/* What the paged attention kernels share (cpu_paged_attention.c, which plans the work and has the
   per-key passes, and cpu_attention_blocked.c, the blocked passes for prefill rows): the unit of
   work, walking the keys through the block table, and the softmax. The layout contract is
   cpu_paged_attention.c's. */

#ifndef V1ENGINE_CPU_ATTENTION_H
#define V1ENGINE_CPU_ATTENTION_H

#include <math.h>

#include "cpu_vectors.h"

#define MAX_HEAD_VECS 16 /* the vector path takes head sizes up to 16 * LANES */
#define ROW_BLOCK 8     /* query rows of one sequence attended together */

struct attention_shape {
    long num_heads, num_kv_heads, head_size, block_size, window;
    float scale;
    float soft_cap; /* > 0: each score s becomes soft_cap * tanh(s / soft_cap) (Gemma 2) */
    /* [num_heads]: where query head h's KV head (h / (num_heads / num_kv_heads)) starts in a
       cache row, in elements; computed once per call (a division costs tens of cycles, and the
       passes would otherwise divide once per group of keys) */
    const long *head_offset;
};

/* One unit: `rows` query rows; the keys first .. first + n - 1 that any of them sees; row r sees
   keys first + lo[r] .. first + hi[r] (lo/hi relative to first). */
struct unit {
    long rows, first, n;
    long lo[ROW_BLOCK], hi[ROW_BLOCK];
};

/* Where a walk over the keys stands: block `block` of the table, row `offset` in it. Advanced
   LANES positions at a time, so that only its start divides by the block size. */
struct cursor {
    long block, offset;
};

static inline struct cursor cursor_at(long pos, long block_size)
{
    return (struct cursor){pos / block_size, pos % block_size};
}

/* Where the table's `block`-th block starts in the cache (`block_bytes` = block_size rows). */
static inline const char *block_start(const char *cache, const int32_t *table, long block,
                                      long block_bytes)
{
    return cache + (long)table[block] * block_bytes;
}

/* The cache rows of the next `count` (<= LANES) positions at *at, which it then advances past
   them, walking the block table block by block; slots past `count` repeat the last row, so that
   a partial group reads valid memory. */
static inline void group_rows(const char **rows, const char *cache, const int32_t *table,
                              struct cursor *at, long count, long block_size, long row_bytes)
{
    const long block_bytes = block_size * row_bytes;
    const char *base = block_start(cache, table, at->block, block_bytes);
    for (long j = 0; j < count; j++) {
        rows[j] = base + at->offset * row_bytes;
        if (++at->offset == block_size) {
            at->offset = 0;
            if (j + 1 < count) base = block_start(cache, table, ++at->block, block_bytes);
            else at->block++;
        }
    }
    for (long j = count; j < LANES; j++) rows[j] = rows[count - 1];
}

/* The cache rows of the LANES positions after *at (where group_rows left it), whole rows up to
   the end of their block, to be asked for in `steps` slices while the current group is worked on.

   The per-key passes read a group's rows head by head (a 256-byte slice of each of 16 rows, then
   the next slice), and the next group is often another block elsewhere in the cache: the
   hardware prefetcher follows neither, so a decode's keys came in at ~15 GB/s per thread, under
   half of what a plain read gets. Prefetching the next group at once (192 lines at SmolLM2's
   shape) helped (64 decodes over 192 keys: 0.40 against 0.47 ms per layer without it), but most of
   such a burst cannot be in flight together, and the lines it fails to start come in later as
   misses that stall the work. Asked for a slice before each query head's work instead, they
   stream in while it runs: `bench_attention.py --cold --baseline-ref` (caches evicted before
   every call, as in the engine), 2-core AMD EPYC (Zen 5), float32, 64 decodes over 96 / 192 /
   512 keys: 0.25 / 0.55 / 1.38 against 0.34 / 0.63 / 1.61 ms per layer, with the last group of
   keys also asking for the first group of values. The lines go to L2 (prefetcht1), not L1: on a
   2-core Zen 4 (EPYC family 25 model 17) a prefetch into L1 stalled once L1's few miss buffers
   were full (a third of both passes' cycles sat on it, `perf annotate`), while L2 keeps many
   more lines in flight and the passes then read them from there: 0.83 / 1.02 / 2.26 against
   1.04 / 1.35 / 3.28 ms per layer at 144 / 192 / 512 keys (same command), and the 64-decode
   step of `bench_decode.py` went from 436 to 479 tok/s (same tokens); prefetching two groups
   ahead instead of one measured no better. bfloat16, with half the lines a slice, measured
   level either way (within the 2-5% by which two builds of the same source differed there).
   Not in the blocked passes: a prefill's units re-read the same keys from L2 there, and the
   extra instructions made them 25-35% slower. */
struct pending {
    const char *start;
    long lines, per_step, next;
};

static inline struct pending pending_group(const char *cache, const int32_t *table,
                                           const struct cursor *at, long remaining,
                                           long block_size, long row_bytes, long steps)
{
    if (remaining <= 0) return (struct pending){0, 0, 0, 0};
    long rows = block_size - at->offset;
    if (rows > LANES) rows = LANES;
    if (rows > remaining) rows = remaining;
    const char *start =
        block_start(cache, table, at->block, block_size * row_bytes) + at->offset * row_bytes;
    const long lines = (rows * row_bytes + 63) / 64;
    return (struct pending){start, lines, (lines + steps - 1) / steps, 0};
}

/* Asks for the next slice of p's lines, into L2 (above). */
static inline void prefetch_slice(struct pending *p)
{
    for (long i = 0; i < p->per_step && p->next < p->lines; i++, p->next++)
        __builtin_prefetch(p->start + p->next * 64, 0, 2);
}

/* The keys i0 .. i0 + count - 1 that row r sees, as j0 .. j1 - 1 (j1 <= j0: none). */
static inline void seen(const struct unit *u, long r, long i0, long count, long *j0, long *j1)
{
    *j0 = u->lo[r] > i0 ? u->lo[r] - i0 : 0;
    *j1 = u->hi[r] + 1 - i0 < count ? u->hi[r] + 1 - i0 : count;
}

/* The largest of p[0 .. n-1], LANES at a time (a scalar running maximum waits on itself). */
static inline float maximum(const float *p, long n)
{
    vec top = (vec){0} - INFINITY;
    long i = 0;
    for (; i + LANES <= n; i += LANES) {
        vec v = load_f32(p + i);
        int_vec larger = v > top; /* all ones where v is larger (C has no vector ?:) */
        top = (vec)(((int_vec)v & larger) | ((int_vec)top & ~larger));
    }
    float best = -INFINITY;
    for (int l = 0; l < LANES; l++) best = top[l] > best ? top[l] : best;
    for (; i < n; i++) best = p[i] > best ? p[i] : best;
    return best;
}

/* scores [rows, H, n] -> the softmax's numerators e^(score - max) per row and head, in place
   (-inf scores become 0), and 1 / their sum per row and head in `inverse_totals`: the values pass
   scales its sums by it once, instead of a division per score here. With soft_cap > 0 the
   scores are capped first (keys a row does not see stay -inf). */
static inline void softmax(float *scores, long num_rows, long n, float soft_cap,
                           float *inverse_totals)
{
    for (long r = 0; r < num_rows; r++) {
        float *p = scores + r * n;
        if (soft_cap > 0.f)
            for (long i = 0; i < n; i++)
                if (p[i] != -INFINITY) p[i] = soft_cap * tanhf(p[i] / soft_cap);
        float top = maximum(p, n), total = 0.f;
        _Pragma("omp simd reduction(+:total)")
        for (long i = 0; i < n; i++) total += p[i] = v1e_expf(p[i] - top);
        inverse_totals[r] = 1.f / total;
    }
}

/* One unit by the blocked passes (cpu_attention_blocked.c): 1 if it did it, 0 if the unit is not
   theirs (`blocked_passes_take`) or its key rows could not be allocated, for the per-key passes
   to do. */
int v1e_attention_blocked_f32(const float *q, const char *k_cache, const char *v_cache,
                              const int32_t *table, const struct unit *u,
                              const struct attention_shape *sh, float *scores, float *out);
int v1e_attention_blocked_bf16(const uint16_t *q, const char *k_cache, const char *v_cache,
                               const int32_t *table, const struct unit *u,
                               const struct attention_shape *sh, float *scores, uint16_t *out);

/* Which passes take a prompt's whole units of rows for these heads: 2 the blocked passes with
   their blocks full (two or more query heads per KV head), 1 the blocked passes with 8 of a
   block's 12 query vectors (one query head per KV head), 0 the per-key passes (head sizes other
   than 64 and 128, CPUs without AVX-512). */
int v1e_attention_prefill_passes(long num_heads, long num_kv_heads, long head_size);

#endif
