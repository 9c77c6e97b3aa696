/* Every decoder layer of a Llama-shaped model, and the final norm, for the tokens of a small CPU
   step (up to the rows linear.py sends to our matmul kernels: decodes, or a few prompt tokens
   among them), in one call.

   At batch 1 a layer is about ten small ops (two norms, three matmuls, rotary, the K/V write,
   attention, SiLU-and-mul). Called one by one from Python each costs 10-30 us of dispatch (module
   call, checks, ctypes) around a few microseconds of work, about a quarter of a SmolLM2 step
   (scripts/profile_steps.py). Here the same kernels run back to back: this file only sequences
   them, with the arithmetic, the order and the roundings of the layer-by-layer forward
   (models/llama.py), so its outputs are bit-identical to it (tests/model/test_decode_stack.py).

   A layer: residual += x; h = RMSNorm(residual); qkv = h Wqkv^T (+ b); optional RMSNorm per q and
   k head (Qwen3); neox rotary; K/V written at the step's slots; paged attention;
   x = attn Wo^T (+ b after, as a row-parallel layer adds it); residual += x; h = RMSNorm(residual);
   x = (SiLU(gate) * up) Wdown^T (+ b after). The first layer's residual is the embeddings; the
   stack ends with residual += x and the model's final RMSNorm. Tensor parallelism 1 only (no
   all-reduce here); the KV cache has the model's dtype. A step whose every token runs one LoRA
   adapter (lora/layers.py) adds its delta after each matmul, as the layers do: y += (x A^T) B,
   with A and B the adapter's slot in that matmul's `lora_a` and `lora_b` (B transposed); its
   bits are not the layers' (another matmul kernel, another summation order), its tokens are.
   Built with the other kernels into one library (cpu_kernel_library.py); returns nonzero if a
   buffer could not be allocated. */

#include <stdlib.h>

#include "cpu_kernels.h"

/* One layer's weights (bias, q_norm, k_norm may be NULL) and caches; all contiguous. */
struct v1e_decoder_layer {
    const void *input_norm, *qkv_weight, *qkv_bias, *q_norm, *k_norm, *o_weight, *o_bias;
    const void *post_norm, *gate_up_weight, *gate_up_bias, *down_weight, *down_bias;
    /* The matmul weights packed for cpu_gemm_packed.c (float32), or NULL. */
    const void *qkv_packed, *o_packed, *gate_up_packed, *down_packed;
    void *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_size] */
    long kv_cache_group;     /* which of the step's block tables and slots the layer reads */
    long block_size, window; /* window 0: full attention */
    /* With LoRA (else NULL), per matmul: every slot's A [slots * width, in] and B transposed
       [slots * width, out], `width` rows a slot (lora/layers.py's `a`, `b_t`, `slot_width`). */
    const void *qkv_lora_a, *qkv_lora_b, *o_lora_a, *o_lora_b;
    const void *gate_up_lora_a, *gate_up_lora_b, *down_lora_a, *down_lora_b;
    long qkv_lora_width, o_lora_width, gate_up_lora_width, down_lora_width;
};

struct v1e_decoder_shape {
    long hidden, num_heads, num_kv_heads, head_size, intermediate;
    float eps, scale;
    long gemv_max_tokens;   /* cpu_kernels.max_gemv_tokens: up to it the gemv */
    long packed_max_tokens; /* cpu_kernels.max_gemm_packed_tokens: up to it the packed gemm */
};

/* The step: `tokens` query rows of `num_seqs` sequences, and per KV cache group g their slots,
   block table, sequence lengths and row bounds (as cpu_attention_backend.CpuAttentionMetadata
   holds them; query_start_locs[g] NULL: one row per sequence). */
struct v1e_decode_step {
    long tokens, num_seqs;
    const void *cos, *sin; /* [tokens, head_size] */
    const int64_t *const *slots;
    const int32_t *const *block_tables;
    const long *table_strides;
    const int32_t *const *seq_lens;
    const int32_t *const *query_start_locs;
    long lora_slot; /* the LoRA slot every token runs, or -1: none */
};

/* The widths of q, k (and v) and the fused qkv rows, derived once per call from the shape. */
struct widths {
    long q, kv, qkv;
};

static struct widths widths_of(const struct v1e_decoder_shape *sh)
{
    const long q = sh->num_heads * sh->head_size, kv = sh->num_kv_heads * sh->head_size;
    return (struct widths){q, kv, q + 2 * kv};
}

/* y = x W^T (+ b) by the kernel linear.py picks for M rows, so that the stack's bits are the
   layers': for float32 the gemv up to gemv_max_tokens, the gemm on the packed weight wp up to
   packed_max_tokens, the tiled gemm on w past it; for bfloat16 the gemv, then the tiled gemm
   where the CPU has AVX512-BF16 (the Python side sends bfloat16 steps here only up to the rows
   the two take). Nonzero if the kernel could not allocate. */
static int matmul_f32(const struct v1e_decoder_shape *sh, const float *x, const void *w,
                      const void *wp, const void *b, float *y, long M, long N, long K)
{
    if (M <= sh->gemv_max_tokens) return v1e_gemv_f32(x, w, b, y, M, N, K);
    if (wp && M <= sh->packed_max_tokens) {
        v1e_gemm_packed_f32(x, wp, b, y, M, N, K);
        return 0;
    }
    return v1e_gemm_f32(x, w, b, y, M, N, K);
}

static int matmul_bf16(const struct v1e_decoder_shape *sh, const uint16_t *x, const void *w,
                       const void *wp, const void *b, uint16_t *y, long M, long N, long K)
{
    (void)wp;
#if defined(__AVX512BF16__)
    if (M > sh->gemv_max_tokens) return v1e_gemm_bf16(x, w, b, y, M, N, K);
#else
    (void)sh;
#endif
    return v1e_gemv_bf16(x, w, b, y, M, N, K);
}

#define DECODER_STACK(S, T, LOAD, STORE)                                                       \
    /* The step's activations, [tokens, width] each. */                                        \
    struct buffers_##S {                                                                       \
        T *residual, *h, *x, *qkv, *q_normed, *k_normed, *q, *k, *attn, *gate_up, *act;        \
        T *lora_x;       /* [tokens, the widest slot]: x A^T */                                \
        float *lora_acc; /* [the widest output]: one row's y + (x A^T) B */                    \
        long lora_slot;                                                                        \
    };                                                                                         \
                                                                                               \
    /* y [M, N] += (x [M, K] A^T) B, A and B^T the `width` rows of the step's slot in a and    \
       b; nothing without LoRA. Nonzero if the matmul could not allocate. */                   \
    static int add_lora_##S(const struct v1e_decoder_shape *sh, struct buffers_##S *buf,       \
                            const T *x, const void *a, const void *b, long width, T *y, long M, \
                            long N, long K)                                                    \
    {                                                                                          \
        if (buf->lora_slot < 0 || !a) return 0;                                                \
        const T *slot_a = (const T *)a + buf->lora_slot * width * K;                           \
        const T *slot_b = (const T *)b + buf->lora_slot * width * N;                           \
        if (matmul_##S(sh, x, slot_a, NULL, NULL, buf->lora_x, M, width, K)) return 1;         \
        float *acc = buf->lora_acc;                                                            \
        for (long m = 0; m < M; m++) {                                                         \
            for (long n = 0; n < N; n++) acc[n] = LOAD(y[m * N + n]);                          \
            for (long r = 0; r < width; r++) {                                                 \
                const float t = LOAD(buf->lora_x[m * width + r]);                              \
                const T *row = slot_b + r * N;                                                 \
                for (long n = 0; n < N; n++) acc[n] += t * LOAD(row[n]);                       \
            }                                                                                  \
            for (long n = 0; n < N; n++) y[m * N + n] = STORE(acc[n]);                         \
        }                                                                                      \
        return 0;                                                                              \
    }                                                                                          \
                                                                                               \
    static void add_bias_##S(T *y, const T *b, long M, long N)                                 \
    {                                                                                          \
        for (long m = 0; m < M; m++)                                                           \
            for (long n = 0; n < N; n++) y[m * N + n] = STORE(LOAD(y[m * N + n]) + LOAD(b[n])); \
    }                                                                                          \
                                                                                               \
    /* qkv -> the rotated q [M, H, D] and k [M, KVH, D]; q/k normalized per head first. */     \
    static void rotated_qk_##S(const struct v1e_decoder_layer *L,                             \
                               const struct v1e_decoder_shape *sh, const struct widths *w,     \
                               const struct v1e_decode_step *st, struct buffers_##S *b)        \
    {                                                                                          \
        const long M = st->tokens, D = sh->head_size, NH = sh->num_heads;                      \
        const long NKV = sh->num_kv_heads;                                                     \
        const T *q = b->qkv, *k = b->qkv + w->q;                                               \
        long q_stride = w->qkv, k_stride = w->qkv;                                             \
        if (L->q_norm) {                                                                       \
            for (long t = 0; t < M; t++) {                                                     \
                v1e_rms_norm_##S(q + t * w->qkv, NULL, L->q_norm, NULL, b->q_normed + t * w->q, \
                                 NH, D, sh->eps);                                              \
                v1e_rms_norm_##S(k + t * w->qkv, NULL, L->k_norm, NULL,                        \
                                 b->k_normed + t * w->kv, NKV, D, sh->eps);                    \
            }                                                                                  \
            q = b->q_normed, k = b->k_normed, q_stride = w->q, k_stride = w->kv;               \
        }                                                                                      \
        v1e_rotary_##S(q, k, st->cos, st->sin, b->q, b->k, M, NH, NKV, D, q_stride, k_stride); \
    }                                                                                          \
                                                                                               \
    /* b->h (the normalized residual) -> b->x, the attention block's output. */                \
    static int attention_block_##S(const struct v1e_decoder_layer *L,                          \
                                   const struct v1e_decoder_shape *sh, const struct widths *w, \
                                   const struct v1e_decode_step *st, struct buffers_##S *b)    \
    {                                                                                          \
        const long M = st->tokens, g = L->kv_cache_group;                                      \
        if (matmul_##S(sh, b->h, L->qkv_weight, L->qkv_packed, L->qkv_bias, b->qkv, M, w->qkv, \
                       sh->hidden) ||                                                          \
            add_lora_##S(sh, b, b->h, L->qkv_lora_a, L->qkv_lora_b, L->qkv_lora_width, b->qkv, \
                         M, w->qkv, sh->hidden))                                               \
            return 1;                                                                          \
        rotated_qk_##S(L, sh, w, st, b);                                                       \
        v1e_write_kv((const char *)b->k, (const char *)(b->qkv + w->q + w->kv), L->k_cache,    \
                     L->v_cache, st->slots[g], M, w->kv * sizeof(T), w->qkv * sizeof(T),       \
                     w->kv * sizeof(T));                                                       \
        if (v1e_paged_attention_##S(b->q, L->k_cache, L->v_cache, st->block_tables[g],         \
                                    st->seq_lens[g], st->query_start_locs[g], b->attn,         \
                                    st->num_seqs, sh->num_heads, sh->num_kv_heads,             \
                                    sh->head_size, L->block_size, st->table_strides[g],        \
                                    L->window, sh->scale, 0.f))                                \
            return 1;                                                                          \
        if (matmul_##S(sh, b->attn, L->o_weight, L->o_packed, NULL, b->x, M, sh->hidden,       \
                       w->q) ||                                                                \
            add_lora_##S(sh, b, b->attn, L->o_lora_a, L->o_lora_b, L->o_lora_width, b->x, M,   \
                         sh->hidden, w->q))                                                    \
            return 1;                                                                          \
        if (L->o_bias) add_bias_##S(b->x, L->o_bias, M, sh->hidden);                           \
        return 0;                                                                              \
    }                                                                                          \
                                                                                               \
    static int mlp_block_##S(const struct v1e_decoder_layer *L,                                \
                             const struct v1e_decoder_shape *sh, long M, struct buffers_##S *b) \
    {                                                                                          \
        const long I = sh->intermediate;                                                       \
        if (matmul_##S(sh, b->h, L->gate_up_weight, L->gate_up_packed, L->gate_up_bias,        \
                       b->gate_up, M, 2 * I, sh->hidden) ||                                    \
            add_lora_##S(sh, b, b->h, L->gate_up_lora_a, L->gate_up_lora_b,                    \
                         L->gate_up_lora_width, b->gate_up, M, 2 * I, sh->hidden))             \
            return 1;                                                                          \
        v1e_silu_and_mul_##S(b->gate_up, b->act, M, I);                                        \
        if (matmul_##S(sh, b->act, L->down_weight, L->down_packed, NULL, b->x, M, sh->hidden,  \
                       I) ||                                                                   \
            add_lora_##S(sh, b, b->act, L->down_lora_a, L->down_lora_b, L->down_lora_width,    \
                         b->x, M, sh->hidden, I))                                              \
            return 1;                                                                          \
        if (L->down_bias) add_bias_##S(b->x, L->down_bias, M, sh->hidden);                     \
        return 0;                                                                              \
    }                                                                                          \
                                                                                               \
    /* Carves the buffers out of one allocation, which b->residual starts, and with LoRA the   \
       float row of another; 0 if either failed. */                                           \
    static int allocate_##S(const struct v1e_decoder_shape *sh, const struct widths *w,       \
                            const struct v1e_decoder_layer *L, long M, struct buffers_##S *b)  \
    {                                                                                          \
        const long H = sh->hidden, I = sh->intermediate;                                       \
        long lora = 0; /* the widest slot */                                                   \
        const long slot_widths[] = {L->qkv_lora_width, L->o_lora_width,                        \
                                    L->gate_up_lora_width, L->down_lora_width};                \
        for (long i = 0; b->lora_slot >= 0 && i < 4; i++)                                      \
            if (slot_widths[i] > lora) lora = slot_widths[i];                                  \
        T **parts[] = {&b->residual, &b->h, &b->x, &b->qkv, &b->q_normed, &b->k_normed,        \
                       &b->q, &b->k, &b->attn, &b->gate_up, &b->act, &b->lora_x};              \
        const long sizes[] = {H, H, H, w->qkv, w->q, w->kv, w->q, w->kv, w->q, 2 * I, I, lora}; \
        const long n = sizeof sizes / sizeof sizes[0];                                         \
        long total = 0;                                                                        \
        for (long i = 0; i < n; i++) total += M * sizes[i];                                    \
        T *p = malloc(sizeof(T) * total);                                                      \
        for (long i = 0; p && i < n; p += M * sizes[i], i++) *parts[i] = p;                   \
        b->lora_acc = NULL;                                                                    \
        if (!p || !lora) return p != NULL;                                                     \
        long widest = H; /* the widest matmul output */                                        \
        if (w->qkv > widest) widest = w->qkv;                                                  \
        if (2 * I > widest) widest = 2 * I;                                                    \
        b->lora_acc = malloc(sizeof(float) * widest);                                          \
        if (!b->lora_acc) free(b->residual);                                                   \
        return b->lora_acc != NULL;                                                            \
    }                                                                                          \
                                                                                               \
    /* x [tokens, hidden]: the embeddings -> out [tokens, hidden]: the final norm's output. */ \
    int v1e_decoder_stack_##S(const struct v1e_decoder_layer *layers, long num_layers,         \
                              const struct v1e_decoder_shape *sh,                              \
                              const struct v1e_decode_step *st, const T *x,                    \
                              const T *final_norm, T *out)                                     \
    {                                                                                          \
        const long M = st->tokens, H = sh->hidden;                                             \
        const struct widths w = widths_of(sh);                                                 \
        struct buffers_##S b = {.lora_slot = st->lora_slot};                                   \
        if (!allocate_##S(sh, &w, layers, M, &b)) return 1;                                    \
        memcpy(b.residual, x, sizeof(T) * M * H);                                              \
        v1e_rms_norm_##S(x, NULL, layers[0].input_norm, NULL, b.h, M, H, sh->eps);             \
        int failed = 0;                                                                        \
        for (long l = 0; l < num_layers; l++) {                                                \
            const struct v1e_decoder_layer *L = layers + l;                                    \
            if (l > 0)                                                                         \
                v1e_rms_norm_##S(b.x, b.residual, L->input_norm, b.residual, b.h, M, H,        \
                                 sh->eps);                                                     \
            if ((failed = attention_block_##S(L, sh, &w, st, &b))) break;                      \
            v1e_rms_norm_##S(b.x, b.residual, L->post_norm, b.residual, b.h, M, H, sh->eps);   \
            if ((failed = mlp_block_##S(L, sh, M, &b))) break;                                 \
        }                                                                                      \
        if (!failed)                                                                           \
            v1e_rms_norm_##S(b.x, b.residual, final_norm, b.residual, out, M, H, sh->eps);     \
        free(b.residual);                                                                      \
        free(b.lora_acc);                                                                      \
        return failed;                                                                         \
    }

DECODER_STACK(f32, float, AS_FLOAT, AS_FLOAT)
DECODER_STACK(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
