/* Greedy and beam search of an encoder-decoder transformer in C, without torch: s2s.native_search
 * compiles this file with native_attention.c, native_linear.c, native_int8.c and native_thread.c
 * (cc -O3 -march=native) into a library of its own, loaded through ctypes, and ``s2s translate`` decodes
 * plain searches with it on a CPU with AMX or AVX512-BF16 (bf16 products) or with AVX2 (int8
 * products), where importing torch took longer than a greedy search.
 *
 * The same model as s2s.model.transformer (docs/model.md (1)-(21)), for one batch of sources:
 *
 *   Enc:  x_j = Norm_E(E[src_j] s_E + PE(j)),  then each block (pre-norm)
 *             x <- x + W_O MHA(Norm1(x)),  x <- x + FFN(Norm2(x)),  H_enc = Norm_enc(x)
 *   Dec:  x_t = Norm_E(E[y_t] s_E + PE(t)),  then each block
 *             x <- x + W_O SelfAttn(Norm1(x), K/V of y_<=t),
 *             x <- x + W_O CrossAttn(Norm2(x), K/V = H_enc W_KV),  x <- x + FFN(Norm3(x))
 *         z_t = (s_U Norm_dec(x)) W_U + b_U   (in fp32: the sums not rounded)
 *
 * (post-norm: x <- Norm(x + Sublayer(x)) and no final norms), searched greedily (y_t+1 = argmax_v
 * z_t[v]), by sampling (y_t+1 ~ q, s2s.search.sampling_distribution) or by beam search over log p =
 * log_softmax(z_t) (s2s.search.beam_search), with the search's rules (s2s.search.constrain): pad
 * and <s> never chosen, </s> blocked while t < min_len, no n-gram twice (decode.no_repeat_ngram),
 * and </s> the only choice at t = max_len - 1; a forced prefix's token (--prefix-file, a target
 * language's token) the only choice at its step, at the model's log p, before every rule.  Every
 * product is s2s_bf16_linear's (W packed once into
 * AMX's tile layout, run on AMX or vdpbf16ps, x rounded to bf16, sums in fp32, y rounded to bf16)
 * or, for a model packed for int8, s2s_i8_linear's (W quantized once row by row, x row by row per
 * call, sums exact in int32, y rounded to bf16); with a shortlist, the output projection over the
 * batch's ids alone; the residual stream, the norms
 * and the attention's softmax and sums run in fp32; the attention is s2s_few_query_attention's
 * over bf16 K/V, one sentence (or beam) at a time over its own positions (no padding, no mask).
 * A sentence's rows leave the step's products once its search has ended.
 */
#include <math.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int s2s_bf16_linear_isa(void);
int s2s_bf16_linear(const uint16_t *x, long x_row, long M, long N, long K, const uint16_t *P, const uint16_t *b,
                    int act, uint16_t *y, long y_row);
void s2s_bf16_pack(const uint16_t *W, long w_row, long N, long K, uint16_t *P);
int s2s_few_query_attention(const float *q, long q_b, long q_h, long q_g, const void *k, long k_b, long k_h,
                            long k_s, const void *v, long v_b, long v_h, long v_s, const float *mask, long m_b,
                            long m_h, long m_g, const int64_t *columns, long group, long capacity, float *out, long B,
                            long H, long G, long S, long D, float c, int kv_bf16);
int s2s_bf16_linear_f32(const uint16_t *x, long x_row, long M, long N, long K, const uint16_t *P, const uint16_t *b,
                        float *y, long y_row);
int s2s_i8_linear_available(void);
int s2s_i8_linear(const uint16_t *x, long x_row, long M, long N, long K, const void *Q, const uint16_t *b, int act,
                  uint16_t *y, float *y32, long y_row);
void s2s_i8_pack(const int8_t *Wq, const float *scale, const int32_t *ids, long N, long K, void *Q);
void *s2s_thread_block(int which, size_t bytes);
enum { S2S_BLOCK_SEARCH = 0 }; /* native_thread.c's blocks: this file's */
int s2s_argmax_rows_f32(const float *z, long z_row, long N, long V, float *best, int64_t *index);
float s2s_log_softmax_shift(const float *z, long V, float *tops);
float s2s_exp_weights(const float *z, long V, float top, float s, float *w);

#define SHIFT_BLOCK 64 /* native_attention.c's blocks of scores, each with its maximum */

enum { ACT_RELU = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_SILU = 3 };

/* y = x W^T + b: W (N, K) packed by s2s_bf16_pack (P; int8 0) or by s2s_i8_pack (int8 1: int8
 * products, native_int8.c), b bf16 or NULL */
typedef struct {
    const void *P;
    const uint16_t *b;
    long N, K;
    int int8;
} s2s_linear;

/* LayerNorm(x) = (x - mean) / sqrt(var + eps) g + b,  RMSNorm(x) = x / sqrt(mean(x^2) + eps) g (b NULL);
 * g NULL: no norm there */
typedef struct {
    const float *g, *b;
} s2s_norm;

typedef struct {
    s2s_norm norm1, norm2, norm3;        /* norm3: the decoder's */
    s2s_linear qkv, self_out;            /* self-attention: [W_Q; W_K; W_V], W_O */
    s2s_linear q, kv, cross_out;         /* the decoder's cross-attention: W_Q, [W_K; W_V], W_O */
    s2s_linear w1, w3, w2;               /* FFN; w3.P NULL unless gated: W_2 (act(W_1 x) * W_3 x) */
} s2s_layer;

typedef struct {
    long d, heads, d_head, d_ff, vocab, enc_layers, dec_layers;
    int pre_norm, rms, activation, pad_id, bos_id, eos_id;
    float eps, embed_scale, output_scale, attention_scale;
    const float *src_embed, *tgt_embed; /* E (vocab, d) fp32 */
    const float *enc_positions, *dec_positions; /* PE (rows, d) fp32: the sinusoidal table, or each stack's learned one */
    s2s_norm enc_embed_norm, dec_embed_norm, enc_final_norm, dec_final_norm;
    s2s_linear output;                  /* W_U (vocab, d) packed, b_U */
    const s2s_layer *enc, *dec;
    const int32_t *tgt_ids; /* NULL, or a shortlist's: output v is target id tgt_ids[v] (vocab of them) */
} s2s_model;

/* ---- element-wise pieces ---- */

static inline uint16_t bf16_round(float f) /* to nearest, ties to even; NaN stays NaN */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_widen(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* P (s2s_bf16_pack's layout) from fp32 W (N, K), each element rounded to bf16 once */
int s2s_pack_f32(const float *W, long N, long K, uint16_t *P)
{
    uint16_t *w = malloc(sizeof(uint16_t) * (size_t)(N * K + 1));
    if (!w)
        return -1;
    for (long i = 0; i < N * K; i++)
        w[i] = bf16_round(W[i]);
    s2s_bf16_pack(w, K, N, K, P);
    free(w);
    return 0;
}

/* ---- a vocabulary shortlist (s2s.shortlist): the target ids a batch may produce ---- */

/* ids (ascending, returns how many) = the union of the k listed target ids of each of the n_src
 * source ids src (top: (V_src, k), -1 padded), the F frequent ones and the n_always always; ids
 * outside 0 .. V - 1 are skipped (s2s_ids_outside says whether a table has any).  mark: V bytes of
 * scratch. */
long s2s_shortlist_subset(const int32_t *top, long k, const int32_t *src, long n_src, const int32_t *frequent, long F,
                          const int32_t *always, long n_always, long V, unsigned char *mark, int32_t *ids)
{
    memset(mark, 0, (size_t)V);
    for (long i = 0; i < n_src; i++)
        for (long j = 0; j < k; j++) {
            const int32_t t = top[(long)src[i] * k + j];
            if (t >= 0 && t < V)
                mark[t] = 1;
        }
    for (long i = 0; i < F + n_always; i++) {
        const int32_t t = i < F ? frequent[i] : always[i - F];
        if (t >= 0 && t < V)
            mark[t] = 1;
    }
    long n = 0;
    for (long v = 0; v < V; v++)
        if (mark[v])
            ids[n++] = (int32_t)v;
    return n;
}

/* how many of x[0 .. n) lie outside lo .. V - 1 */
long s2s_ids_outside(const int32_t *x, long n, long lo, long V)
{
    long bad = 0;
    for (long i = 0; i < n; i++)
        bad += x[i] < lo || x[i] >= V;
    return bad;
}

/* P (s2s_bf16_pack's layout) of rows ids[0 .. n) of bf16 W (rows K apart), and b_sub[i] = b[ids[i]]
 * where b is not NULL: a batch's output projection over its shortlist.  Returns 0, -1 where
 * memory cannot be allocated. */
int s2s_pack_rows(const uint16_t *W, long K, const int32_t *ids, long n, const uint16_t *b, uint16_t *P,
                  uint16_t *b_sub)
{
    uint16_t *rows = malloc(sizeof(uint16_t) * (size_t)(n * K) + 1);
    if (!rows)
        return -1;
    for (long i = 0; i < n; i++) {
        memcpy(rows + i * K, W + (long)ids[i] * K, sizeof(uint16_t) * (size_t)K);
        if (b)
            b_sub[i] = b[ids[i]];
    }
    s2s_bf16_pack(rows, K, n, K, P);
    free(rows);
    return 0;
}

/* s2s_pack_rows for int8 products: Q (s2s_i8_pack's layout) of rows ids[0 .. n) of q(W) (int8,
 * rows K apart, their scales s_W), and b_sub as there */
void s2s_pack_rows_i8(const int8_t *Wq, const float *scale, long K, const int32_t *ids, long n, const uint16_t *b,
                      void *Q, uint16_t *b_sub)
{
    s2s_i8_pack(Wq, scale, ids, n, K, Q);
    for (long i = 0; b && i < n; i++)
        b_sub[i] = b[ids[i]];
}

/* PE(pos)[i] = sin(pos w_i), PE(pos)[d/2 + i] = cos(pos w_i), w_i = 10000^(-2i/d) (an odd d: a last 0),
 * for pos < rows: s2s.model.positions.sinusoidal_table, in fp32 as it computes it */
void s2s_sinusoidal_table(long rows, long d, float *table)
{
    const long half = d / 2;
    for (long p = 0; p < rows; p++) {
        float *row = table + p * d;
        for (long i = 0; i < half; i++) {
            const float w = expf(-logf(10000.0f) * (float)(2 * i) / (float)d);
            const float angle = (float)p * w;
            row[i] = sinf(angle);
            row[half + i] = cosf(angle);
        }
        if (d % 2)
            row[d - 1] = 0.0f;
    }
}

/* y[r] = Norm(x[r]) for r < rows (n.g NULL: y = x), in fp32 */
static void norm_rows(const float *x, long rows, long d, s2s_norm n, int rms, float eps, float *y)
{
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        if (!n.g) {
            memmove(yr, xr, sizeof(float) * (size_t)d);
            continue;
        }
        float mean = 0.0f, var = 0.0f;
        if (!rms) {
            for (long i = 0; i < d; i++)
                mean += xr[i];
            mean /= (float)d;
        }
        for (long i = 0; i < d; i++)
            var += (xr[i] - mean) * (xr[i] - mean);
        const float inv = 1.0f / sqrtf(var / (float)d + eps);
        for (long i = 0; i < d; i++)
            yr[i] = (xr[i] - mean) * inv * n.g[i] + (n.b ? n.b[i] : 0.0f);
    }
}

/* y = bf16(x), n elements (to nearest, ties to even) */
void s2s_to_bf16(const float *x, long n, uint16_t *y)
{
    for (long i = 0; i < n; i++)
        y[i] = bf16_round(x[i]);
}

/* x = Norm(x + widen(o)) (post-norm) or x += widen(o) (pre-norm: n.g NULL) */
static void residual(float *x, const uint16_t *o, long rows, long d, s2s_norm n, int rms, float eps)
{
    for (long i = 0; i < rows * d; i++)
        x[i] += bf16_widen(o[i]);
    if (n.g)
        norm_rows(x, rows, d, n, rms, eps, x);
}

static inline float activate(float x, int activation)
{
    switch (activation) {
    case ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case ACT_GELU_TANH: return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
    case ACT_SILU: return x / (1.0f + expf(-x));
    default: return x > 0.0f ? x : 0.0f;
    }
}

/* ---- the blocks ---- */

typedef struct {
    float *x, *q;             /* the residual stream (rows, d); queries widened (rows, heads d_head) */
    uint16_t *a, *big, *gate; /* a sublayer's input (rows, max(d, heads d_head)); qkv or FFN hidden; gated FFN */
    float *att;               /* one sentence's attention output (heads, queries, d_head) */
} workspace;

/* y (rows, L->N) = act(x L^T + b) in bf16, or in fp32 into y32 where it is not NULL (relu 0) */
static int mul_into(const s2s_linear *L, const uint16_t *x, long rows, int relu, uint16_t *y, float *y32)
{
    if (L->int8)
        return s2s_i8_linear(x, L->K, rows, L->N, L->K, L->P, L->b, relu, y, y32, L->N);
    return y32 ? s2s_bf16_linear_f32(x, L->K, rows, L->N, L->K, L->P, L->b, y32, L->N)
               : s2s_bf16_linear(x, L->K, rows, L->N, L->K, L->P, L->b, relu, y, L->N);
}

static int mul(const s2s_linear *L, const uint16_t *x, long rows, int relu, uint16_t *y)
{
    return mul_into(L, x, rows, relu, y, NULL);
}

/* nonzero where this process has the kernel of the model's products (bf16's, or int8's) */
static int has_kernel(const s2s_model *m)
{
    return m->output.int8 ? s2s_i8_linear_available() : s2s_bf16_linear_isa() != 0;
}

/* a (rows, d) bf16 = Norm(x) (pre-norm), or x itself (post-norm) */
static void sublayer_input(const s2s_model *m, const float *x, long rows, s2s_norm n, workspace *w)
{
    if (m->pre_norm) {
        norm_rows(x, rows, m->d, n, m->rms, m->eps, w->q); /* (q: scratch of rows x d floats, d <= its width) */
        s2s_to_bf16(w->q, rows * m->d, w->a);
    } else {
        s2s_to_bf16(x, rows * m->d, w->a);
    }
}

/* x <- x + FFN(Norm(x)), or Norm(x + FFN(x)) */
static int feed_forward(const s2s_model *m, const s2s_layer *l, float *x, long rows, s2s_norm n, workspace *w)
{
    const long f = m->d_ff;
    int rc = 0;
    sublayer_input(m, x, rows, n, w);
    const int relu_inside = m->activation == ACT_RELU && !l->w3.P;
    rc |= mul(&l->w1, w->a, rows, relu_inside, w->big);
    if (l->w3.P)
        rc |= mul(&l->w3, w->a, rows, 0, w->gate);
    if (!relu_inside)
        for (long i = 0; i < rows * f; i++) {
            float h = activate(bf16_widen(w->big[i]), m->activation);
            if (l->w3.P)
                h *= bf16_widen(w->gate[i]);
            w->big[i] = bf16_round(h);
        }
    rc |= mul(&l->w2, w->big, rows, 0, w->a);
    residual(x, w->a, rows, m->d, m->pre_norm ? (s2s_norm){0} : n, m->rms, m->eps);
    return rc;
}

/* (heads, G, d_head) fp32 -> row j of ctx (G, heads d_head) bf16: the heads merged */
static void merge_heads(const float *att, long heads, long G, long D, uint16_t *ctx)
{
    for (long h = 0; h < heads; h++)
        for (long j = 0; j < G; j++)
            for (long e = 0; e < D; e++)
                ctx[j * heads * D + h * D + e] = bf16_round(att[(h * G + j) * D + e]);
}

/* x (n_tok, d) fp32 = E[tok] s_E + PE(pos), then the embeddings' norm */
static void embed(const s2s_model *m, const float *E, const float *PE, const int32_t *tok, const long *pos,
                  long n_tok, s2s_norm n, float *x)
{
    const long d = m->d;
    for (long r = 0; r < n_tok; r++) {
        const float *e = E + (long)tok[r] * d, *p = PE + pos[r] * d;
        for (long i = 0; i < d; i++)
            x[r * d + i] = e[i] * m->embed_scale + p[i];
    }
    if (n.g)
        norm_rows(x, n_tok, d, n, m->rms, m->eps, x);
}

/* ---- the search ---- */

/* What a search of one batch holds: the encoder's output as each decoder layer's cross-attention
 * K/V, each row's self-attention K/V, and the scratch of a step. */
typedef struct {
    workspace w;
    long B, n_tok, blocks, cap; /* sentences, their source positions, self-attention caches, a cache's K/V rows */
    long *offset, *pos;     /* sentence b's first source position; a row's position */
    int32_t *tok;           /* a step's input tokens (the encoder's: the sources') */
    int32_t *tok_id;        /* with a shortlist (m->tgt_ids): a step's input tokens as target ids */
    uint16_t *cross_kv;     /* (dec_layers, n_tok, 2 HD): k then v of each source position */
    uint16_t *self_k, *self_v; /* (dec_layers, blocks, cap, HD) */
    float *z;               /* a step's scores (rows, vocab) */
} batch;

/* ---- memory: one block per thread, kept from batch to batch ---- */

/* A search carves its buffers out of its thread's block (64-byte aligned), which grows to the
 * largest batch the thread has searched and is freed when the thread ends.  Allocated afresh for
 * every batch, each batch faulted its pages in again: a 10,000-line beam-5 run of the quickstart
 * model took 16.3-16.9 s and peaked at 241-248 MB that way, against 14.9 s and 206 MB with the
 * block kept and the caches' pages handed back (release_caches), 186-188 MB for 1,000 lines. */
typedef struct {
    char *base; /* NULL: only count */
    size_t used;
} carver;

static void *carve(carver *c, size_t bytes)
{
    void *p = c->base ? c->base + c->used : (void *)64;
    c->used += (bytes + 63) & ~(size_t)63;
    return p;
}

#define CARVE(c, ptr, n) ((ptr) = carve((c), sizeof *(ptr) * (size_t)(n)))

/* this thread's block of a batch's buffers (native_thread.c) */
static char *thread_block(size_t bytes) { return s2s_thread_block(S2S_BLOCK_SEARCH, bytes); }

/* the pages inside [p, p + bytes) handed back to the system (they read as zeros when next touched):
 * the self-attention caches after a search, whose slots past a batch's last step are never written,
 * so that the block does not keep every page some batch once touched (a 50,000-line beam search
 * peaked at 242 MB that way, against 186 for 1,000 lines) */
static void release_pages(void *p, size_t bytes)
{
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t lo = ((uintptr_t)p + page - 1) & ~(page - 1), hi = ((uintptr_t)p + bytes) & ~(page - 1);
    if (hi > lo)
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

static void release_caches(const s2s_model *m, batch *s)
{
    const size_t bytes = sizeof(uint16_t) * (size_t)(m->dec_layers * s->blocks * s->cap * m->heads * m->d_head);
    release_pages(s->self_k, bytes);
    release_pages(s->self_v, bytes);
}

/* the batch's buffers for B sentences of src_len source positions, ``rows`` decoder rows at most, and
 * ``blocks`` self-attention caches of ``cap`` K/V rows */
static void lay_out_batch(const s2s_model *m, batch *s, carver *c, long B, const long *src_len, long rows,
                          long blocks, long cap)
{
    const long d = m->d, HD = m->heads * m->d_head, f = m->d_ff;
    long n_tok = 0, S_max = 0;
    for (long b = 0; b < B; b++) {
        n_tok += src_len[b];
        S_max = src_len[b] > S_max ? src_len[b] : S_max;
    }
    memset(s, 0, sizeof *s);
    s->B = B, s->n_tok = n_tok, s->blocks = blocks, s->cap = cap;
    const long rows_max = n_tok > rows ? n_tok : rows, width = d > HD ? d : HD;
    const long big = 3 * HD > f ? 3 * HD : f;
    CARVE(c, s->w.x, rows_max * d);
    CARVE(c, s->w.q, rows_max * width);
    CARVE(c, s->w.a, rows_max * width);
    CARVE(c, s->w.big, rows_max * big);
    CARVE(c, s->w.gate, rows_max * f);
    CARVE(c, s->w.att, S_max * HD);
    CARVE(c, s->offset, B + 1);
    CARVE(c, s->pos, rows_max);
    CARVE(c, s->tok, rows_max);
    CARVE(c, s->tok_id, rows_max);
    CARVE(c, s->cross_kv, m->dec_layers * n_tok * 2 * HD);
    CARVE(c, s->self_k, m->dec_layers * blocks * cap * HD);
    CARVE(c, s->self_v, m->dec_layers * blocks * cap * HD);
    CARVE(c, s->z, rows * m->vocab);
}

/* The encoder over every real position of the batch (sentence b's at offset[b]), then each decoder
 * layer's cross-attention K/V from H_enc.  Nonzero where a product failed. */
static int encode(const s2s_model *m, batch *s, const int32_t *src, long src_stride, const long *src_len)
{
    const long d = m->d, H = m->heads, D = m->d_head, HD = H * D, n_tok = s->n_tok;
    workspace *w = &s->w;
    float *x = w->x;
    int rc = 0;
    s->offset[0] = 0;
    for (long b = 0; b < s->B; b++) {
        s->offset[b + 1] = s->offset[b] + src_len[b];
        for (long j = 0; j < src_len[b]; j++) {
            s->tok[s->offset[b] + j] = src[b * src_stride + j];
            s->pos[s->offset[b] + j] = j;
        }
    }
    embed(m, m->src_embed, m->enc_positions, s->tok, s->pos, n_tok, m->enc_embed_norm, x);
    for (long i = 0; i < m->enc_layers; i++) {
        const s2s_layer *l = m->enc + i;
        sublayer_input(m, x, n_tok, l->norm1, w);
        rc |= mul(&l->qkv, w->a, n_tok, 0, w->big); /* (n_tok, 3 HD): q, k, v of each position */
        for (long r = 0; r < n_tok; r++)
            for (long e = 0; e < HD; e++)
                w->q[r * HD + e] = bf16_widen(w->big[r * 3 * HD + e]);
        for (long b = 0; b < s->B; b++) { /* each sentence's positions attend to its own */
            const long L = src_len[b], o = s->offset[b];
            const uint16_t *k = w->big + o * 3 * HD + HD, *v = k + HD;
            rc |= s2s_few_query_attention(w->q + o * HD, 0, D, HD, k, 0, D, 3 * HD, v, 0, D, 3 * HD, NULL, 0, 0, 0,
                                          NULL, 1, 0, w->att, 1, H, L, L, D, m->attention_scale, 1);
            merge_heads(w->att, H, L, D, w->a + o * HD);
        }
        rc |= mul(&l->self_out, w->a, n_tok, 0, w->big);
        residual(x, w->big, n_tok, d, m->pre_norm ? (s2s_norm){0} : l->norm1, m->rms, m->eps);
        rc |= feed_forward(m, l, x, n_tok, l->norm2, w);
    }
    norm_rows(x, n_tok, d, m->pre_norm ? m->enc_final_norm : (s2s_norm){0}, m->rms, m->eps, w->q); /* H_enc */
    s2s_to_bf16(w->q, n_tok * d, w->a);
    for (long i = 0; i < m->dec_layers; i++)
        rc |= mul(&m->dec[i].kv, w->a, n_tok, 0, s->cross_kv + i * n_tok * 2 * HD);
    return rc;
}

/* One decoder step of N rows at position t: row i reads token s->tok[i], is sentence sent[i] (its
 * cross-attention), writes its self-attention K/V at row slot[i] of cache block block[i] and
 * attends to the t + 1 rows cols[i] (i (t + 1) apart; NULL: rows 0 .. t) of that block.  Leaves
 * z = (s_U Norm(x)) W_U + b_U (N, vocab) in s->z.  Nonzero where a product or an attention failed. */
static int decoder_step(const s2s_model *m, batch *s, long N, long t, const long *sent, const long *block,
                        const long *slot, const int64_t *cols)
{
    const long d = m->d, H = m->heads, D = m->d_head, HD = H * D, cap = s->cap;
    workspace *w = &s->w;
    float *x = w->x;
    int rc = 0;
    for (long i = 0; i < N; i++)
        s->pos[i] = t;
    const int32_t *tok = s->tok; /* (outputs v: the shortlist's v-th id) */
    if (m->tgt_ids) {
        for (long i = 0; i < N; i++)
            s->tok_id[i] = m->tgt_ids[s->tok[i]];
        tok = s->tok_id;
    }
    embed(m, m->tgt_embed, m->dec_positions, tok, s->pos, N, m->dec_embed_norm, x);
    for (long li = 0; li < m->dec_layers; li++) {
        const s2s_layer *l = m->dec + li;
        uint16_t *Kc = s->self_k + li * s->blocks * cap * HD, *Vc = s->self_v + li * s->blocks * cap * HD;
        /* 1. self-attention over y_<=t: this step's K/V written at the row's slot */
        sublayer_input(m, x, N, l->norm1, w);
        rc |= mul(&l->qkv, w->a, N, 0, w->big);
        for (long i = 0; i < N; i++) {
            const uint16_t *row = w->big + i * 3 * HD;
            const long at = (block[i] * cap + slot[i]) * HD;
            memcpy(Kc + at, row + HD, sizeof(uint16_t) * (size_t)HD);
            memcpy(Vc + at, row + 2 * HD, sizeof(uint16_t) * (size_t)HD);
            for (long e = 0; e < HD; e++)
                w->q[i * HD + e] = bf16_widen(row[e]);
        }
        for (long i = 0; i < N; i++) {
            const long at = block[i] * cap * HD;
            rc |= s2s_few_query_attention(w->q + i * HD, 0, D, HD, Kc + at, 0, D, HD, Vc + at, 0, D, HD, NULL, 0, 0, 0,
                                          cols ? cols + i * (t + 1) : NULL, 1, cap, w->att, 1, H, 1, t + 1, D,
                                          m->attention_scale, 1);
            s2s_to_bf16(w->att, HD, w->a + i * HD);
        }
        rc |= mul(&l->self_out, w->a, N, 0, w->big);
        residual(x, w->big, N, d, m->pre_norm ? (s2s_norm){0} : l->norm1, m->rms, m->eps);
        /* 2. cross-attention over the sentence's H_enc */
        sublayer_input(m, x, N, l->norm2, w);
        rc |= mul(&l->q, w->a, N, 0, w->big);
        for (long e = 0; e < N * HD; e++)
            w->q[e] = bf16_widen(w->big[e]);
        const uint16_t *kv = s->cross_kv + li * s->n_tok * 2 * HD;
        for (long i = 0; i < N; i++) {
            const long b = sent[i], S = s->offset[b + 1] - s->offset[b];
            const uint16_t *k = kv + s->offset[b] * 2 * HD, *v = k + HD;
            rc |= s2s_few_query_attention(w->q + i * HD, 0, D, HD, k, 0, D, 2 * HD, v, 0, D, 2 * HD, NULL, 0, 0, 0,
                                          NULL, 1, 0, w->att, 1, H, 1, S, D, m->attention_scale, 1);
            s2s_to_bf16(w->att, HD, w->a + i * HD);
        }
        rc |= mul(&l->cross_out, w->a, N, 0, w->big);
        residual(x, w->big, N, d, m->pre_norm ? (s2s_norm){0} : l->norm2, m->rms, m->eps);
        /* 3. feed-forward */
        rc |= feed_forward(m, l, x, N, l->norm3, w);
    }
    norm_rows(x, N, d, m->pre_norm ? m->dec_final_norm : (s2s_norm){0}, m->rms, m->eps, w->q);
    for (long e = 0; e < N * d; e++)
        w->a[e] = bf16_round(w->q[e] * m->output_scale);
    rc |= mul_into(&m->output, w->a, N, 0, NULL, s->z);
    return rc;
}

/* the search's rules on row z (s2s.search.constrain): pad and <s> never (unless <s> is </s>),
 * </s> not while t < min_len */
static void block_specials(const s2s_model *m, float *z, long t, long min_len)
{
    z[m->pad_id] = -INFINITY;
    if (m->bos_id != m->eos_id)
        z[m->bos_id] = -INFINITY;
    if (t < min_len)
        z[m->eos_id] = -INFINITY;
}

/* The tokens v that would make (y_{t-n+2}, ..., y_t, v) an n-gram h (t tokens so far) already
 * holds (s2s.search.block_repeated_ngrams: decode.no_repeat_ngram n; none before t >= n), each
 * window's last token for every window whose first n - 1 are h's last n - 1, into banned (at
 * most t of them); returns how many. */
static long repeated_ngram_ends(const int32_t *h, long t, long n, int32_t *banned)
{
    long count = 0;
    for (long j = 0; n > 0 && j + n <= t; j++)
        if (!memcmp(h + j, h + t - n + 1, sizeof(int32_t) * (size_t)(n - 1)))
            banned[count++] = h[j + n - 1];
    return count;
}

/* ---- sampling (s2s.search.sampling_distribution): y ~ q ---- */

/* the next of a row's random numbers, uniform in [0, 1): splitmix64 (Steele, Lea and Flood 2014)
 * over the row's state, which s2s.native_search seeds from decode.seed, the line and the sample */
static inline double next_uniform(uint64_t *state)
{
    uint64_t x = (*state += 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (double)(x >> 11) * 0x1.0p-53;
}

/* the k-th largest of z's V values (1 <= k <= V), through a min-heap of k of them */
static float kth_largest(const float *z, long V, long k, float *heap)
{
    for (long v = 0; v < V; v++) {
        long i;
        if (v < k) { /* sift up */
            for (i = v; i > 0 && heap[(i - 1) / 2] > z[v]; i = (i - 1) / 2)
                heap[i] = heap[(i - 1) / 2];
        } else if (z[v] > heap[0]) { /* replace the least, sift down */
            for (i = 0;;) {
                long c = 2 * i + 1;
                if (c >= k)
                    break;
                if (c + 1 < k && heap[c + 1] < heap[c])
                    c++;
                if (!(heap[c] < z[v]))
                    break;
                heap[i] = heap[c];
                i = c;
            }
        } else {
            continue;
        }
        heap[i] = z[v];
    }
    return heap[0];
}

typedef struct {
    float w;
    int32_t v;
} weighted;

static int heavier_first(const void *a, const void *b) /* w descending, then v ascending */
{
    const weighted *x = a, *y = b;
    return x->w > y->w ? -1 : x->w < y->w ? 1 : (x->v > y->v) - (x->v < y->v);
}

/* A token drawn from q(v) = e^(z[v] / T) / sum, z a row's V scores with the search's rules applied
 * (-inf: blocked) and top their maximum, restricted as s2s.search.sampling_distribution restricts
 * it: to the top_k (> 0) most probable (ties at the k-th kept), then to those whose more probable
 * tokens' mass under q (before top_k's cut) is below top_p (< 1; the most probable always kept).
 * w (V floats) and by (V) are scratch, heap top_k floats; state the row's random numbers. */
static int32_t sample_token(const float *z, long V, float top, float inv_t, long top_k, float top_p, float *w,
                            weighted *by, float *heap, uint64_t *state)
{
    s2s_exp_weights(z, V, top, inv_t, w);
    const float kth = top_k > 0 && top_k < V ? kth_largest(z, V, top_k, heap) : -INFINITY;
    double all = 0.0, kept = 0.0; /* q's mass (times e^(-top / T)), and top_k's share of it, summed as the draw sums */
    long n_kept = 0;
    for (long v = 0; v < V; v++) {
        all += w[v];
        if (z[v] < kth)
            w[v] = 0.f;
        kept += w[v];
        n_kept += w[v] > 0.f;
    }
    if (top_p < 1.f && kept > top_p * all) {
        /* a token is kept while the mass before it is below top_p: those of weight at most
         * (kept - top_p all) / n_kept have at least top_p before them, so only the heavier are sorted */
        const double need = top_p * all, light = (kept - need) / (double)n_kept;
        long n = 0;
        for (long v = 0; v < V; v++)
            if (w[v] > light || z[v] == top) /* (the most probable always: a top_p too small to hold it) */
                by[n++] = (weighted){w[v], (int32_t)v};
        qsort(by, (size_t)n, sizeof *by, heavier_first);
        double before = 0.0;
        long chosen = 0;
        while (chosen < n && (chosen == 0 || before < need))
            before += by[chosen++].w;
        const double u = next_uniform(state) * before;
        double acc = 0.0;
        for (long j = 0; j < chosen; j++)
            if (u < (acc += by[j].w))
                return by[j].v;
        return by[chosen - 1].v;
    }
    const double u = next_uniform(state) * kept;
    double acc = 0.0;
    int32_t last = -1;
    for (long v = 0; v < V; v++) {
        if (w[v] <= 0.f)
            continue;
        last = (int32_t)v;
        if (u < (acc += w[v]))
            return last;
    }
    return last;
}

/* The token sentence b is forced to take at step t (s2s.search.forced_tokens), or -1: prefix (B,
 * prefix_stride), prefix_len[b] of them; prefix NULL: none */
static inline int32_t forced_token(const int32_t *prefix, long prefix_stride, const long *prefix_len, long b, long t)
{
    return prefix && t < prefix_len[b] ? prefix[b * prefix_stride + t] : -1;
}

/* Greedy search of B sources: src (B, src_stride) token ids, sentence b's src_len[b] of them (its
 * </s> included, at least 1); max_len[b] >= 1 its longest output (</s> included), more than
 * prefix_len[b]; prefix (NULL: none) each output's forced first tokens (forced_token); seeds (NULL:
 * the most probable token each step) each sentence's random state for drawing its tokens from q
 * (sample_token: temperature, top_k, top_p).  out (B,
 * out_stride >= max_len[b]) gets each output's tokens, out_len[b] of them (</s> not included);
 * out_logp (NULL: not computed) each output's log p, </s> included, as s2s.search.greedy_search
 * sums it: each step's log_softmax over the whole vocabulary, taken before the rules block
 * tokens (at max_len, </s>'s own log p, 0 where it is blocked).
 * Returns 0; -1 where memory cannot be allocated, -2 where there is no kernel for the model's
 * products (bf16's or int8's, in this library or this process), -3 where a step's scores hold
 * NaN, -4 where a kernel failed (its scratch could not be allocated). */
int s2s_greedy(const s2s_model *m, long B, const int32_t *src, long src_stride, const long *src_len,
               const long *max_len, long min_len, const int32_t *prefix, long prefix_stride, const long *prefix_len,
               const uint64_t *seeds, float temperature, long top_k, float top_p, long no_repeat_ngram,
               int32_t *out, long out_stride, long *out_len, float *out_logp)
{
    if (!has_kernel(m))
        return -2;
    long T_max = 0;
    for (long b = 0; b < B; b++)
        T_max = max_len[b] > T_max ? max_len[b] : T_max;
    batch s;
    long *live, *slot;
    float *best, *shift, *logp, *block_top, *forced_z, *w = NULL, *heap = NULL;
    int64_t *choice;
    int32_t *banned = NULL;
    uint64_t *rng = NULL;
    weighted *by = NULL;
    const long V = m->vocab, k_heap = top_k > 0 && top_k < V ? top_k : 1;
    carver c = {NULL, 0};
    for (int pass = 0; pass < 2; pass++) { /* count, then carve the thread's block */
        lay_out_batch(m, &s, &c, B, src_len, B, B, T_max);
        CARVE(&c, live, B), CARVE(&c, slot, B), CARVE(&c, best, B), CARVE(&c, choice, B);
        CARVE(&c, shift, B), CARVE(&c, logp, B), CARVE(&c, block_top, m->vocab / SHIFT_BLOCK + 1);
        CARVE(&c, forced_z, B);
        if (seeds)
            CARVE(&c, rng, B), CARVE(&c, w, V), CARVE(&c, by, V), CARVE(&c, heap, k_heap);
        if (no_repeat_ngram > 0)
            CARVE(&c, banned, T_max);
        if (!pass && !(c.base = thread_block(c.used)))
            return -1;
        c.used = 0;
    }
    int rc = encode(m, &s, src, src_stride, src_len) ? -4 : 0;
    long N = B; /* live[i]: the sentence of the step's row i, and its cache block */
    for (long b = 0; b < B; b++) {
        live[b] = b;
        s.tok[b] = m->bos_id;
        out_len[b] = 0;
        logp[b] = 0.0f;
        if (seeds)
            rng[b] = seeds[b];
    }
    for (long t = 0; !rc && N > 0 && t < T_max; t++) {
        for (long i = 0; i < N; i++)
            slot[i] = t;
        if (decoder_step(m, &s, N, t, live, live, slot, NULL)) {
            rc = -4;
            break;
        }
        for (long i = 0; i < N && out_logp; i++) { /* log p = z - log sum exp z, before the rules */
            shift[i] = s2s_log_softmax_shift(s.z + i * m->vocab, m->vocab, block_top);
            if (shift[i] != shift[i])
                rc = -3;
        }
        for (long i = 0; i < N; i++) { /* a forced token's z, before the rules */
            const int32_t f = forced_token(prefix, prefix_stride, prefix_len, live[i], t);
            forced_z[i] = f >= 0 ? s.z[i * m->vocab + f] : 0.0f;
            block_specials(m, s.z + i * m->vocab, t, min_len);
            const long n_banned = no_repeat_ngram > 0
                ? repeated_ngram_ends(out + live[i] * out_stride, t, no_repeat_ngram, banned) : 0;
            for (long j = 0; j < n_banned; j++)
                s.z[i * m->vocab + banned[j]] = -INFINITY;
        }
        if (rc || s2s_argmax_rows_f32(s.z, m->vocab, N, m->vocab, best, choice)) {
            rc = -3;
            break;
        }
        long kept = 0; /* a sentence's row leaves once it has chosen </s> */
        for (long i = 0; i < N; i++) {
            const long b = live[i];
            const int32_t f = forced_token(prefix, prefix_stride, prefix_len, b, t);
            const float *zi = s.z + i * V;
            const int32_t y = f >= 0 ? f : max_len[b] <= t + 1 ? m->eos_id
                : seeds && !isinf(best[i]) /* (every token blocked: the argmax's 0, as greedy's) */
                ? sample_token(zi, V, best[i], 1.0f / temperature, top_k, top_p, w, by, heap, rng + b)
                : (int32_t)choice[i];
            if (out_logp) { /* at max_len </s> alone, at its own log p (0 where it is blocked) */
                const float z = f >= 0 ? forced_z[i] : zi[y];
                logp[b] += isinf(z) ? 0.0f : z - shift[i];
            }
            if (y == m->eos_id) {
                out_len[b] = t;
                if (out_logp)
                    out_logp[b] = logp[b];
                continue;
            }
            out[b * out_stride + t] = y;
            live[kept] = b;
            s.tok[kept++] = y;
        }
        N = kept;
    }
    release_caches(m, &s);
    return rc;
}

enum { LP_GNMT = 0, LP_POWER = 1, LP_NONE = 2 };

/* lp(m) = ((5 + m) / 6)^alpha (gnmt), m^alpha (power) or 1 (s2s.search.length_penalty) */
static double length_penalty(double len, double alpha, int kind)
{
    return kind == LP_GNMT ? pow((5.0 + len) / 6.0, alpha) : kind == LP_POWER ? pow(len, alpha) : 1.0;
}

typedef struct {
    float score;
    long index; /* beam k V + token v */
} candidate;

/* c (n, the best first; ties: the lower index first) gains x where it is among the n best */
static void keep_best(candidate *c, long n, long *have, float score, long index)
{
    if (*have == n && !(score > c[n - 1].score))
        return;
    long i = *have < n ? (*have)++ : n - 1;
    while (i > 0 && score > c[i - 1].score) {
        c[i] = c[i - 1];
        i--;
    }
    c[i] = (candidate){score, index};
}

/* Beam search of width K of B sources (src, src_len and max_len as s2s_greedy's), as
 * s2s.search.beam_search: each step the 2K best continuations of a sentence's K beams
 * (cumulative log p), </s> among the K best joining its finished hypotheses (scored log p /
 * lp(m), the K best kept), the K best others going on; a sentence stops once its nbest-th
 * finished hypothesis scores at least what a live beam may still reach (``exact``: the better
 * of the best live log p over lp(m + 1) and over lp(max_len); else over lp(m + 1) alone), or
 * at max_len.  Beams keep their self-attention K/V in slots, K per position, each beam reading
 * its own ancestors' (no copies when beams are reordered).  Sentence b's n-th best hypothesis
 * (n < nbest) goes to out[(b nbest + n) out_stride ...], out_len[b nbest + n] tokens (-1: none),
 * its score and log p to score[b nbest + n], logp[...].  A forced token (prefix, as s2s_greedy's) is
 * each beam's only continuation at its step.  Returns as s2s_greedy. */
int s2s_beam(const s2s_model *m, long B, const int32_t *src, long src_stride, const long *src_len,
             const long *max_len, long min_len, const int32_t *prefix, long prefix_stride, const long *prefix_len,
             long no_repeat_ngram, long K, long nbest, double alpha, int lp_kind, int exact, int32_t *out,
             long out_stride, long *out_len, float *out_score, float *out_logp)
{
    if (!has_kernel(m))
        return -2;
    const long V = m->vocab;
    long T_max = 0;
    for (long b = 0; b < B; b++)
        T_max = max_len[b] > T_max ? max_len[b] : T_max;
    const long R = B * K; /* row b K + k: beam k of sentence b */
    batch s;
    long *sent, *slot, *row_of, *fin_len; /* row_of: the step's row i is beam row row_of[i] */
    int64_t *cols, *step_cols, *cols_next;
    int32_t *hist, *hist_next, *fin_tok, *banned;
    float *score, *score_next, *fin_score, *fin_logp, *block_top;
    unsigned char *ended;
    candidate *cand;
    carver c = {NULL, 0};
    for (int pass = 0; pass < 2; pass++) { /* count, then carve the thread's block */
        lay_out_batch(m, &s, &c, B, src_len, R, B, T_max * K);
        CARVE(&c, sent, R), CARVE(&c, slot, R), CARVE(&c, row_of, R), CARVE(&c, fin_len, R);
        CARVE(&c, cols, R * T_max), CARVE(&c, step_cols, R * T_max), CARVE(&c, cols_next, R * T_max);
        CARVE(&c, hist, R * T_max), CARVE(&c, hist_next, R * T_max), CARVE(&c, fin_tok, R * T_max);
        CARVE(&c, score, R), CARVE(&c, score_next, R), CARVE(&c, fin_score, R), CARVE(&c, fin_logp, R);
        CARVE(&c, block_top, V / SHIFT_BLOCK + 1), CARVE(&c, ended, B), CARVE(&c, cand, 2 * K);
        CARVE(&c, banned, T_max);
        if (!pass && !(c.base = thread_block(c.used)))
            return -1;
        c.used = 0;
    }
    memset(ended, 0, (size_t)B);
    int rc = encode(m, &s, src, src_stride, src_len) ? -4 : 0;
    for (long r = 0; r < R; r++) {
        score[r] = r % K ? -INFINITY : 0.0f; /* all K beams start alike: beam 0 alone is live */
        fin_score[r] = -INFINITY, fin_logp[r] = 0.0f, fin_len[r] = 0;
        s.tok[r] = m->bos_id;
    }
    long live_sentences = B;
    for (long t = 0; !rc && live_sentences > 0 && t < T_max; t++) {
        /* the step's rows: every beam of each sentence still searching (at t = 0 beam 0 alone) */
        long N = 0;
        for (long b = 0; b < B; b++)
            for (long k = 0; k < (t ? K : 1) && !ended[b]; k++) {
                const long r = b * K + k;
                row_of[N] = r, sent[N] = b, slot[N] = t * K + k;
                s.tok[N] = t ? hist[r * T_max + t - 1] : m->bos_id;
                for (long j = 0; j < t; j++) /* its ancestors' slots, then its own */
                    step_cols[N * (t + 1) + j] = cols[r * T_max + j];
                step_cols[N * (t + 1) + t] = t * K + k;
                N++;
            }
        if (decoder_step(m, &s, N, t, sent, sent, slot, step_cols)) {
            rc = -4;
            break;
        }
        const long m_len = t + 1; /* a hypothesis ending at this step, </s> included */
        const double lp = length_penalty((double)m_len, alpha, lp_kind);
        for (long i0 = 0; i0 < N;) { /* one sentence's rows i0 .. i1 - 1 */
            const long b = sent[i0];
            const int32_t forced = forced_token(prefix, prefix_stride, prefix_len, b, t);
            long i1 = i0;
            while (i1 < N && sent[i1] == b)
                i1++;
            long have = 0;
            for (long i = i0; i < i1; i++) {
                const long r = row_of[i], k = r - b * K;
                float *zi = s.z + i * V;
                /* log p = log_softmax(z), then the rules (s2s.search.constrain): pad and <s> never, </s>
                 * not while t < min_len, and at max_len </s> alone, at its log p (0 where blocked) */
                const float shift = s2s_log_softmax_shift(zi, V, block_top);
                if (shift != shift) {
                    rc = -3;
                    goto done;
                }
                const float base = score[r];
                if (forced >= 0) { /* its one continuation, at the model's log p */
                    keep_best(cand, 2 * K, &have, base + (zi[forced] - shift), k * V + forced);
                    continue;
                }
                /* no_repeat_ngram: the n-grams' ends blocked (after log p; the blocks' maxima stay bounds) */
                const long n_banned = no_repeat_ngram > 0
                    ? repeated_ngram_ends(hist + r * T_max, t, no_repeat_ngram, banned) : 0;
                for (long j = 0; j < n_banned; j++)
                    zi[banned[j]] = -INFINITY;
                if (max_len[b] <= m_len) {
                    float eos = zi[m->eos_id] - shift;
                    if (t < min_len || isinf(eos))
                        eos = 0.0f;
                    keep_best(cand, 2 * K, &have, base + eos, k * V + m->eos_id);
                    continue;
                }
                for (long v0 = 0; v0 < V; v0 += SHIFT_BLOCK) {
                    if (have == 2 * K && !((block_top[v0 / SHIFT_BLOCK] - shift) + base > cand[2 * K - 1].score))
                        continue; /* no score of this block is among the best */
                    const long v1 = v0 + SHIFT_BLOCK < V ? v0 + SHIFT_BLOCK : V;
                    for (long v = v0; v < v1; v++) {
                        if (v == m->pad_id || (v == m->bos_id && m->bos_id != m->eos_id) ||
                            (v == m->eos_id && t < min_len))
                            continue;
                        keep_best(cand, 2 * K, &have, (zi[v] - shift) + base, k * V + v);
                    }
                }
            }
            for (long c = have; c < 2 * K; c++)
                cand[c] = (candidate){-INFINITY, 0};
            /* 1. finish: </s> among the K best joins the finished hypotheses, the K best of them kept */
            float *fs = fin_score + b * K, *fl = fin_logp + b * K;
            long *fn = fin_len + b * K;
            int32_t *ft = fin_tok + b * K * T_max;
            for (long c = 0; c < K; c++) {
                const long k = cand[c].index / V, v = cand[c].index % V;
                if (v != m->eos_id || isinf(cand[c].score))
                    continue;
                const float norm = (float)(cand[c].score / lp);
                if (!(norm > fs[K - 1]))
                    continue;
                long at = K - 1;
                while (at > 0 && norm > fs[at - 1]) {
                    fs[at] = fs[at - 1], fl[at] = fl[at - 1], fn[at] = fn[at - 1];
                    memcpy(ft + at * T_max, ft + (at - 1) * T_max, sizeof(int32_t) * (size_t)T_max);
                    at--;
                }
                fs[at] = norm, fl[at] = cand[c].score, fn[at] = m_len;
                memcpy(ft + at * T_max, hist + (b * K + k) * T_max, sizeof(int32_t) * (size_t)t);
            }
            /* 2. continue: the K best candidates that did not end (then ended ones, dead: -inf) */
            long kept = 0;
            for (int pass = 0; pass < 2; pass++)
                for (long c = 0; c < 2 * K && kept < K; c++) {
                    const long k = cand[c].index / V, v = cand[c].index % V;
                    if ((v == m->eos_id) != pass)
                        continue;
                    const long r = b * K + kept, parent = b * K + k;
                    score_next[r] = pass ? -INFINITY : cand[c].score;
                    memcpy(hist_next + r * T_max, hist + parent * T_max, sizeof(int32_t) * (size_t)t);
                    hist_next[r * T_max + t] = (int32_t)v;
                    memcpy(cols_next + r * T_max, cols + parent * T_max, sizeof(int64_t) * (size_t)t);
                    cols_next[r * T_max + t] = t * K + k; /* the slot the parent wrote at t */
                    kept++;
                }
            for (long r = b * K; r < b * K + K; r++) {
                score[r] = score_next[r];
                memcpy(hist + r * T_max, hist_next + r * T_max, sizeof(int32_t) * (size_t)(t + 1));
                memcpy(cols + r * T_max, cols_next + r * T_max, sizeof(int64_t) * (size_t)(t + 1));
            }
            /* 3. stop when no live beam can beat the nbest-th finished one, or at max_len */
            const float best_live = score[b * K];
            float bound = -INFINITY;
            if (!isinf(best_live)) {
                bound = (float)(best_live / length_penalty((double)(m_len + 1), alpha, lp_kind));
                if (exact) {
                    const float last = (float)(best_live / length_penalty((double)max_len[b], alpha, lp_kind));
                    bound = last > bound ? last : bound;
                }
            }
            if (fs[nbest - 1] >= bound || max_len[b] <= m_len) {
                ended[b] = 1;
                live_sentences--;
                for (long n = 0; n < nbest; n++) {
                    const long o = b * nbest + n;
                    out_len[o] = isinf(fs[n]) ? -1 : fn[n] - 1;
                    out_score[o] = fs[n], out_logp[o] = fl[n];
                    if (out_len[o] > 0)
                        memcpy(out + o * out_stride, ft + n * T_max, sizeof(int32_t) * (size_t)out_len[o]);
                }
            }
            i0 = i1;
        }
    }
done:
    release_caches(m, &s);
    return rc;
}
