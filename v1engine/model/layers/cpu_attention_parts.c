/* A long decode split by keys between threads: for steps of fewer sequences than threads (batch 1
   above all), where cpu_paged_attention.c would otherwise give each sequence's keys and values to
   one thread while the others wait, and attention grows with the context (at 2,100 tokens of
   SmolLM2 it was 3.4-4.2 ms of a 13.6 ms float32 decode step, streamed by one thread).

   Each part takes a contiguous run of the sequence's keys and computes, per query head, the
   maximum score m, the sum l of e^(score - m) and the unnormalized sum of the weighted values
   (the per-key passes with inverse totals of 1). The merge rescales each part by e^(m_p - M),
   M the largest maximum: out = sum_p e^(m_p - M) s_p / sum_p e^(m_p - M) l_p, as flash decoding
   does. The additions are grouped by part, so the output depends on the number of parts (the
   threads) to within float32 rounding; the same threads give the same bits, and steps of more
   sequences than threads are never split. float32 only (the partial sums are float32, and a
   bfloat16 model would round them once more), vector head sizes, one query row per sequence. */

#include "cpu_attention.h"

#define MIN_PART_KEYS 512 /* a part's keys: fewer and the split's overhead outweighs its gain */

long v1e_key_parts(long threads, long num_seqs, const int32_t *seq_lens,
                   const int32_t *query_start_loc, const struct attention_shape *sh,
                   long element_bytes)
{
    const long G = sh->num_heads / sh->num_kv_heads;
    if (element_bytes != sizeof(float) || num_seqs == 0 || num_seqs >= threads ||
        sh->head_size % LANES || G >= BLOCKED_MIN_QUERIES)
        return 1;
    long fewest = -1;
    for (long s = 0; s < num_seqs; s++) {
        if (query_start_loc && query_start_loc[s + 1] - query_start_loc[s] != 1) return 1;
        const long n = sh->window > 0 && seq_lens[s] > sh->window ? sh->window : seq_lens[s];
        fewest = fewest < 0 || n < fewest ? n : fewest;
    }
    const long by_threads = (threads + num_seqs - 1) / num_seqs, by_keys = fewest / MIN_PART_KEYS;
    return by_threads < by_keys ? by_threads : (by_keys > 1 ? by_keys : 1);
}

void v1e_narrow_to_part(struct unit *u, long part, long parts)
{
    const long a = part * u->n / parts, b = (part + 1) * u->n / parts;
    u->first += a;
    u->n = b - a;
    u->lo[0] = u->lo[0] > a ? u->lo[0] - a : 0;
    u->hi[0] = (u->hi[0] < b - 1 ? u->hi[0] : b - 1) - a;
}

void v1e_merge_parts(const struct key_parts *kp, long num_seqs, const struct attention_shape *sh,
                     float *out)
{
    const long H = sh->num_heads, D = sh->head_size, P = kp->parts;
#pragma omp parallel for
    for (long k = 0; k < num_seqs * H; k++) {
        const long s = k / H, h = k % H;
        const float *maxima = kp->maxima + s * P * H + h, *totals = kp->totals + s * P * H + h;
        float top = -INFINITY, total = 0.f, acc[D];
        for (long p = 0; p < P; p++) top = maxima[p * H] > top ? maxima[p * H] : top;
        for (long d = 0; d < D; d++) acc[d] = 0.f;
        for (long p = 0; p < P; p++) {
            const float weight = v1e_expf(maxima[p * H] - top);
            const float *sums = kp->sums + ((s * P + p) * H + h) * D;
            total += weight * totals[p * H];
            for (long d = 0; d < D; d++) acc[d] += weight * sums[d];
        }
        for (long d = 0; d < D; d++) out[(s * H + h) * D + d] = acc[d] / total;
    }
}
