/* Greedy search of an encoder-decoder transformer in C, without torch: s2s.native_greedy
 * compiles this file with native_attention.c and native_linear.c (cc -O3 -march=native) into a
 * library of its own, loaded through ctypes, and ``s2s translate`` decodes plain greedy
 * searches with it on a CPU with AMX, where importing torch took longer than the search.
 *
 * The same model as s2s.model.transformer (docs/model.md (1)-(21)), for one batch of sources:
 *
 *   Enc:  x_j = Norm_E(E[src_j] s_E + PE(j)),  then each block (pre-norm)
 *             x <- x + W_O MHA(Norm1(x)),  x <- x + FFN(Norm2(x)),  H_enc = Norm_enc(x)
 *   Dec:  x_t = Norm_E(E[y_t] s_E + PE(t)),  then each block
 *             x <- x + W_O SelfAttn(Norm1(x), K/V of y_<=t),
 *             x <- x + W_O CrossAttn(Norm2(x), K/V = H_enc W_KV),  x <- x + FFN(Norm3(x))
 *         z_t = (s_U Norm_dec(x)) W_U + b_U,   y_t+1 = argmax_v z_t[v]
 *
 * (post-norm: x <- Norm(x + Sublayer(x)) and no final norms), with the search's rules
 * (s2s.search.constrain): pad and <s> never chosen, </s> blocked while t < min_len and the
 * only choice at t = max_len - 1.  Every product is s2s_bf16_linear's (W packed once into AMX
 * tiles, x rounded to bf16, sums in fp32, y rounded to bf16); the residual stream, the norms
 * and the attention's softmax and sums run in fp32; the attention is s2s_few_query_attention's
 * over bf16 K/V, one sentence at a time over its own positions (no padding, no mask).  A
 * sentence's row leaves the step's products once it has chosen </s>.
 */
#include <math.h>
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
int s2s_argmax_rows(const uint16_t *z, long z_row, long N, long V, float *best, int64_t *index);

enum { ACT_RELU = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_SILU = 3 };

/* y = x W^T + b: W (N, K) packed by s2s_bf16_pack (P), b bf16 or NULL */
typedef struct {
    const uint16_t *P, *b;
    long N, K;
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

static int mul(const s2s_linear *L, const uint16_t *x, long rows, int relu, uint16_t *y)
{
    return s2s_bf16_linear(x, L->K, rows, L->N, L->K, L->P, L->b, relu, y, L->N);
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

/* Greedy search of B sources: src (B, src_stride) token ids, sentence b's src_len[b] of them (its
 * </s> included, at least 1); max_len[b] >= 1 its longest output (</s> included).  out (B,
 * out_stride >= max_len[b]) gets each output's tokens, out_len[b] of them (</s> not included).
 * Returns 0; -1 where memory cannot be allocated, -2 where there is no AMX kernel (this library
 * or this process), -3 where a step's scores hold NaN. */
int s2s_greedy(const s2s_model *m, long B, const int32_t *src, long src_stride, const long *src_len,
               const long *max_len, long min_len, int32_t *out, long out_stride, long *out_len)
{
    if (!s2s_bf16_linear_isa())
        return -2;
    const long d = m->d, H = m->heads, D = m->d_head, HD = H * D, f = m->d_ff;
    long n_tok = 0, S_max = 0, T_max = 0;
    for (long b = 0; b < B; b++) {
        n_tok += src_len[b];
        S_max = src_len[b] > S_max ? src_len[b] : S_max;
        T_max = max_len[b] > T_max ? max_len[b] : T_max;
    }
    const long rows_max = n_tok > B ? n_tok : B, width = (d > HD ? d : HD);
    const long big_width = 3 * HD > f ? 3 * HD : f;
    workspace w;
    w.x = malloc(sizeof(float) * (size_t)(rows_max * d));
    w.q = malloc(sizeof(float) * (size_t)(rows_max * width));
    w.a = malloc(sizeof(uint16_t) * (size_t)(rows_max * width));
    w.big = malloc(sizeof(uint16_t) * (size_t)(rows_max * (big_width > 2 * HD ? big_width : 2 * HD)));
    w.gate = malloc(sizeof(uint16_t) * (size_t)(rows_max * f));
    w.att = malloc(sizeof(float) * (size_t)(S_max * HD));
    long *offset = malloc(sizeof(long) * (size_t)(B + 1)), *pos = malloc(sizeof(long) * (size_t)rows_max);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)rows_max);
    long *live = malloc(sizeof(long) * (size_t)B);
    uint16_t *cross_kv = malloc(sizeof(uint16_t) * (size_t)(m->dec_layers * n_tok * 2 * HD));
    uint16_t *self_k = malloc(sizeof(uint16_t) * (size_t)(m->dec_layers * B * T_max * HD));
    uint16_t *self_v = malloc(sizeof(uint16_t) * (size_t)(m->dec_layers * B * T_max * HD));
    uint16_t *z = malloc(sizeof(uint16_t) * (size_t)(B * m->vocab));
    float *best = malloc(sizeof(float) * (size_t)B);
    int64_t *choice = malloc(sizeof(int64_t) * (size_t)B);
    int rc = -1;
    if (!w.x || !w.q || !w.a || !w.big || !w.gate || !w.att || !offset || !pos || !tok || !live || !cross_kv ||
        !self_k || !self_v || !z || !best || !choice)
        goto done;
    rc = 0;

    /* the encoder over every real position of the batch: n_tok rows, sentence b at offset[b] */
    offset[0] = 0;
    for (long b = 0; b < B; b++) {
        offset[b + 1] = offset[b] + src_len[b];
        for (long j = 0; j < src_len[b]; j++) {
            tok[offset[b] + j] = src[b * src_stride + j];
            pos[offset[b] + j] = j;
        }
    }
    float *x = w.x;
    embed(m, m->src_embed, m->enc_positions, tok, pos, n_tok, m->enc_embed_norm, x);
    for (long i = 0; i < m->enc_layers; i++) {
        const s2s_layer *l = m->enc + i;
        sublayer_input(m, x, n_tok, l->norm1, &w);
        rc |= mul(&l->qkv, w.a, n_tok, 0, w.big); /* (n_tok, 3 HD): q, k, v of each position */
        for (long r = 0; r < n_tok; r++)
            for (long e = 0; e < HD; e++)
                w.q[r * HD + e] = bf16_widen(w.big[r * 3 * HD + e]);
        for (long b = 0; b < B; b++) { /* each sentence's positions attend to its own */
            const long L = src_len[b], o = offset[b];
            const uint16_t *k = w.big + o * 3 * HD + HD, *v = k + HD;
            rc |= s2s_few_query_attention(w.q + o * HD, 0, D, HD, k, 0, D, 3 * HD, v, 0, D, 3 * HD, NULL, 0, 0, 0,
                                          NULL, 1, 0, w.att, 1, H, L, L, D, m->attention_scale, 1);
            merge_heads(w.att, H, L, D, w.a + o * HD);
        }
        rc |= mul(&l->self_out, w.a, n_tok, 0, w.big);
        residual(x, w.big, n_tok, d, m->pre_norm ? (s2s_norm){0} : l->norm1, m->rms, m->eps);
        rc |= feed_forward(m, l, x, n_tok, l->norm2, &w);
    }
    /* H_enc, then each decoder layer's cross-attention K/V: (n_tok, 2 HD), k then v of a position */
    norm_rows(x, n_tok, d, m->pre_norm ? m->enc_final_norm : (s2s_norm){0}, m->rms, m->eps, w.q);
    s2s_to_bf16(w.q, n_tok * d, w.a);
    for (long i = 0; i < m->dec_layers; i++)
        rc |= mul(&m->dec[i].kv, w.a, n_tok, 0, cross_kv + i * n_tok * 2 * HD);
    if (rc)
        goto done;

    /* the search: live[i] is the sentence of the step's row i */
    long N = B;
    for (long b = 0; b < B; b++) {
        live[b] = b;
        tok[b] = m->bos_id;
        out_len[b] = 0;
    }
    for (long t = 0; N > 0 && t < T_max; t++) {
        for (long i = 0; i < N; i++)
            pos[i] = t;
        embed(m, m->tgt_embed, m->dec_positions, tok, pos, N, m->dec_embed_norm, x);
        for (long li = 0; li < m->dec_layers; li++) {
            const s2s_layer *l = m->dec + li;
            uint16_t *Kc = self_k + li * B * T_max * HD, *Vc = self_v + li * B * T_max * HD;
            /* 1. self-attention over y_<=t: this step's K/V written at column t of each sentence's cache */
            sublayer_input(m, x, N, l->norm1, &w);
            rc |= mul(&l->qkv, w.a, N, 0, w.big);
            for (long i = 0; i < N; i++) {
                const uint16_t *row = w.big + i * 3 * HD;
                const long at = (live[i] * T_max + t) * HD;
                memcpy(Kc + at, row + HD, sizeof(uint16_t) * (size_t)HD);
                memcpy(Vc + at, row + 2 * HD, sizeof(uint16_t) * (size_t)HD);
                for (long e = 0; e < HD; e++)
                    w.q[i * HD + e] = bf16_widen(row[e]);
            }
            for (long i = 0; i < N; i++) {
                const long at = live[i] * T_max * HD;
                rc |= s2s_few_query_attention(w.q + i * HD, 0, D, HD, Kc + at, 0, D, HD, Vc + at, 0, D, HD, NULL, 0, 0,
                                              0, NULL, 1, 0, w.att, 1, H, 1, t + 1, D, m->attention_scale, 1);
                s2s_to_bf16(w.att, HD, w.a + i * HD);
            }
            rc |= mul(&l->self_out, w.a, N, 0, w.big);
            residual(x, w.big, N, d, m->pre_norm ? (s2s_norm){0} : l->norm1, m->rms, m->eps);
            /* 2. cross-attention over the sentence's H_enc */
            sublayer_input(m, x, N, l->norm2, &w);
            rc |= mul(&l->q, w.a, N, 0, w.big);
            for (long e = 0; e < N * HD; e++)
                w.q[e] = bf16_widen(w.big[e]);
            const uint16_t *kv = cross_kv + li * n_tok * 2 * HD;
            for (long i = 0; i < N; i++) {
                const long b = live[i];
                const uint16_t *k = kv + offset[b] * 2 * HD, *v = k + HD;
                rc |= s2s_few_query_attention(w.q + i * HD, 0, D, HD, k, 0, D, 2 * HD, v, 0, D, 2 * HD, NULL, 0, 0, 0,
                                              NULL, 1, 0, w.att, 1, H, 1, src_len[b], D, m->attention_scale, 1);
                s2s_to_bf16(w.att, HD, w.a + i * HD);
            }
            rc |= mul(&l->cross_out, w.a, N, 0, w.big);
            residual(x, w.big, N, d, m->pre_norm ? (s2s_norm){0} : l->norm2, m->rms, m->eps);
            /* 3. feed-forward */
            rc |= feed_forward(m, l, x, N, l->norm3, &w);
        }
        /* z = (s_U Norm(x)) W_U + b_U, the rules, and each row's choice */
        norm_rows(x, N, d, m->pre_norm ? m->dec_final_norm : (s2s_norm){0}, m->rms, m->eps, w.q);
        for (long e = 0; e < N * d; e++)
            w.a[e] = bf16_round(w.q[e] * m->output_scale);
        rc |= mul(&m->output, w.a, N, 0, z);
        if (rc)
            goto done;
        const uint16_t minus_inf = 0xff80;
        for (long i = 0; i < N; i++) {
            uint16_t *zi = z + i * m->vocab;
            zi[m->pad_id] = minus_inf;
            if (m->bos_id != m->eos_id)
                zi[m->bos_id] = minus_inf;
            if (t < min_len)
                zi[m->eos_id] = minus_inf;
        }
        if (s2s_argmax_rows(z, m->vocab, N, m->vocab, best, choice)) {
            rc = -3;
            goto done;
        }
        long kept = 0;
        for (long i = 0; i < N; i++) {
            const long b = live[i];
            const int32_t y = max_len[b] <= t + 1 ? m->eos_id : (int32_t)choice[i];
            if (y == m->eos_id) {
                out_len[b] = t;
                continue;
            }
            out[b * out_stride + t] = y;
            live[kept] = b;
            tok[kept++] = y;
        }
        N = kept;
    }
done:
    free(w.x), free(w.q), free(w.a), free(w.big), free(w.gate), free(w.att);
    free(offset), free(pos), free(tok), free(live), free(cross_kv), free(self_k), free(self_v), free(z), free(best);
    free(choice);
    return rc;
}
