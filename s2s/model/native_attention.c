/* Few-query attention for decoding on the CPU: s2s.model.native compiles this file for the
 * machine it runs on (cc -O3 -march=native); native_op.cpp calls it as torch.ops.s2s.few_query_attention.
 *
 *   out[b,h,j,:] = sum_s A[j,s] V[b,h,s,:],   A[j,:] = softmax_s(c q[b,h,j,:] . K[b,h,s,:] + M[b,h,j,s])
 *
 * for the G queries of a decoding step (1, or a sentence's beams; s2s routes up to 16 here)
 * against one head's K/V, c = 1/sqrt(D) or 1.  Head by head, the scores read the head's K rows, then the
 * weighted sum its V rows; while one streams in from memory the other is prefetched (V's
 * rows during the scores, the next head's K rows during the sum), where two batched matrix
 * products per step read the cache as B x heads small matrices with no look ahead.
 *
 * K and V are fp32 or bf16 (``kv_bf16``: a beam search's self-attention slots, s2s.model.cache),
 * widened to fp32 as they are read; q, M and out are fp32, and every sum runs in fp32.
 * Strides are in elements; the last dimension of every tensor is contiguous.  M may be NULL.
 * ``columns`` (NULL, or B x S, with G = 1): row b's S keys are rows columns[b, :] (each in 0 ..
 * capacity - 1) of K/V row b / group: a beam's self-attention over its own ancestors' slots
 * (s2s.model.cache: t + 1 of its sentence's (t + 1) K columns; the others are never read).
 * Returns 0, -1 where the scores' scratch cannot be allocated, or -2 for a column outside 0 ..
 * capacity - 1.
 *
 * Also (at the end): a greedy step's argmax over bf16 scores, read as they are (s2s_argmax_rows), or
 * over fp32 ones, and a beam step's log_softmax shift (s2s.native_search's).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define S2S_VECTORS 1 /* GCC >= 12, clang: vectors of floats (VL below) for d_head = 16, 32, ..., 128 */
#endif
#endif

#define INLINE static inline __attribute__((always_inline))

/* e^x = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, each step one fused
 * multiply-add, which -fassociative-math cannot merge), |r| <= ln(2) / 2, e^r by Cephes' expf
 * polynomial (within 0.83 ulp of e^x on [-87, 0], measured); 0 below ln(FLT_MIN), so e^-inf = 0 as a masked key's weight must be; NaN stays
 * NaN.  Branch-free: the softmax's loop of it vectorizes, where libm's expf is a call per score. */
#define EXP_REDUCED(T, r) /* e^r, |r| <= ln(2) / 2, for T float or a vector (vN) */ \
    ({                                                                                  \
        T p_ = (T){0} + 1.9875691500e-4f;                                               \
        p_ = p_ * (r) + 1.3981999507e-3f;                                               \
        p_ = p_ * (r) + 8.3334519073e-3f;                                               \
        p_ = p_ * (r) + 4.1665795894e-2f;                                               \
        p_ = p_ * (r) + 1.6666665459e-1f;                                               \
        p_ = p_ * (r) + 5.0000001201e-1f;                                               \
        p_ * (r) * (r) + (r) + 1.0f;                                                    \
    })

INLINE float exp_poly(float x)
{
    const float lo = -87.33654475f, hi = 88.37626266f;
    float xc = x < lo ? lo : (x > hi ? hi : x); /* (not fminf/fmaxf: calls into libm, not vectorized) */
    xc = xc == xc ? xc : 0.f;                   /* NaN (a row with every key masked): n below stays an integer */
    const float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = __builtin_fmaf(n, -0.693359375f, xc);
    r = __builtin_fmaf(n, 2.12194440e-4f, r);
    const float p = EXP_REDUCED(float, r);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23; /* 2^n, n in [-126, 127] */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x < lo ? 0.f : (x == x ? p * two_n : x);
}

/* K/V elements: fp32, or bf16 (the top 16 bits of an fp32) when ``bf16`` (a constant where inlined) */
INLINE const void *kv_at(const int bf16, const void *base, long i)
{
    return (const char *)base + i * (bf16 ? 2 : 4);
}

INLINE float kv_float(const int bf16, const void *base, long i)
{
    if (!bf16)
        return ((const float *)base)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* the D elements of a row, fetched into the cache ahead of their use */
INLINE void prefetch_row(const int bf16, const void *row, long D)
{
    for (long byte = 0; byte < D * (bf16 ? 2 : 4); byte += 64)
        __builtin_prefetch((const char *)row + byte, 0, 3);
}

/* r[s] += m[s] for s < S (m NULL: no mask) */
INLINE void add_mask(float *restrict r, const float *restrict m, long S)
{
    if (m)
        for (long s = 0; s < S; s++)
            r[s] += m[s];
}

/* A[j,:] = softmax(a[j,:] + M[j,:]) in place, for each query j */
INLINE void softmax_rows(float *restrict a, const float *restrict mb, long m_g, long G, long S)
{
    for (long j = 0; j < G; j++) {
        float *restrict r = a + j * S;
        add_mask(r, mb ? mb + j * m_g : NULL, S);
        float top = -INFINITY;
        for (long s = 0; s < S; s++)
            top = r[s] > top ? r[s] : top;
        float sum = 0.f;
        for (long s = 0; s < S; s++) {
            r[s] = exp_poly(r[s] - top);
            sum += r[s];
        }
        const float inv = 1.f / sum;
        for (long s = 0; s < S; s++)
            r[s] *= inv;
    }
}

/* key s of a head: row s of its K/V, or row col[s] where the query row reads given columns (the
 * next head's prefetch aims at the same rows: the same row's next head reads them) */
#define KEY(s) (col ? col[s] : (s))

/* one head, any D: a[j,s] = cq[j,:] . K[s,:], softmax, out[j,:] = sum_s A[j,s] V[s,:] */
INLINE void head_any(const int bf16, const float *restrict cq, const void *restrict kb, long k_s,
                     const void *restrict vb, long v_s, const void *restrict kn, const float *restrict mb, long m_g,
                     const int64_t *restrict col, float *restrict ob, float *restrict a, long G, long S, long D)
{
    for (long s = 0; s < S; s++) {
        const void *restrict ks = kv_at(bf16, kb, KEY(s) * k_s);
        prefetch_row(bf16, kv_at(bf16, vb, KEY(s) * v_s), D);
        for (long j = 0; j < G; j++) {
            const float *restrict qj = cq + j * D;
            float dot = 0.f;
            for (long d = 0; d < D; d++)
                dot += qj[d] * kv_float(bf16, ks, d);
            a[j * S + s] = dot;
        }
    }
    softmax_rows(a, mb, m_g, G, S);
    for (long d = 0; d < G * D; d++)
        ob[d] = 0.f;
    for (long s = 0; s < S; s++) {
        const void *restrict vs = kv_at(bf16, vb, KEY(s) * v_s);
        if (kn)
            prefetch_row(bf16, kv_at(bf16, kn, KEY(s) * k_s), D);
        for (long j = 0; j < G; j++) {
            const float p = a[j * S + s];
            float *restrict o = ob + j * D;
            for (long d = 0; d < D; d++)
                o[d] += p * kv_float(bf16, vs, d);
        }
    }
}

#ifdef S2S_VECTORS
/* The vector code runs on vectors of the registers' width, VL lanes: 16 with AVX-512 (or no
 * AVX2), 8 with AVX2 alone.  (Built for AVX2 alone, GCC 12 made each comparison of 16-float
 * vectors 16 scalar compares and spilled their halves: a beam step's log_softmax shift ran 10x
 * slower, a head 2-3x, than on 8-lane vectors.) */
#if defined(__AVX512F__) || !defined(__AVX2__)
#define VL 16
#else
#define VL 8
#endif
typedef float vN __attribute__((vector_size(4 * VL)));
typedef float vNu __attribute__((vector_size(4 * VL), aligned(4), may_alias)); /* any float address */
typedef int32_t iN __attribute__((vector_size(4 * VL)));
typedef uint16_t u16xNu __attribute__((vector_size(2 * VL), aligned(2), may_alias));
typedef uint32_t u32xN __attribute__((vector_size(4 * VL)));

INLINE vN loadN(const float *p) { return *(const vNu *)p; }
INLINE void storeN(float *p, vN x) { *(vNu *)p = x; }

/* VL K/V elements from element i on, as fp32 (bf16: widened, its 16 bits on top of 16 zero bits) */
INLINE vN kvN(const int bf16, const void *base, long i)
{
    if (!bf16)
        return loadN((const float *)base + i);
    return (vN)(__builtin_convertvector(*(const u16xNu *)((const uint16_t *)base + i), u32xN) << 16);
}

/* lanes of a where m (all ones), of b where not */
INLINE vN selectN(iN m, vN a, vN b) { return (vN)(((iN)a & m) | ((iN)b & ~m)); }

INLINE float max_lanes(vN x)
{
    float m = x[0];
    for (int l = 1; l < VL; l++)
        m = x[l] > m ? x[l] : m;
    return m;
}

INLINE float sum_lanes(vN x)
{
    float sum = 0.f;
    for (int l = 0; l < VL; l++)
        sum += x[l];
    return sum;
}

/* 0, 1, ..., VL - 1 */
INLINE iN lanes(void)
{
    iN lane;
    for (int l = 0; l < VL; l++)
        lane[l] = l;
    return lane;
}

/* exp_poly (above) on VL lanes at once: GCC leaves the scalar loop of it unvectorized (its
 * floorf and selects), where it was most of a head's time (38 cycles a score) */
INLINE vN expN(vN x)
{
    const vN lo = (vN){0} - 87.33654475f, hi = (vN){0} + 88.37626266f;
    const iN is_nan = x != x, below = x < lo;
    vN xc = selectN(below, lo, selectN(x > hi, hi, x));
    xc = selectN(is_nan, (vN){0}, xc);
    const vN z = xc * 1.44269504088896341f + 0.5f; /* n = floor(z), from truncation toward 0 */
    const vN t = __builtin_convertvector(__builtin_convertvector(z, iN), vN);
    const vN n = t - (vN)((iN)((vN){0} + 1.f) & (t > z));
    vN r = n * -0.693359375f + xc;
    __asm__("" : "+m"(r)); /* (ln 2's two parts stay two steps: -fassociative-math would fold them into one) */
    r = n * 2.12194440e-4f + r;
    const vN p = EXP_REDUCED(vN, r);
    const vN two_n = (vN)((__builtin_convertvector(n, iN) + 127) << 23);
    return selectN(is_nan, x, selectN(below, (vN){0}, p * two_n));
}

/* softmax_rows, VL scores at a time.  A block past a row's end reads on into the next row's
 * scores (or the 16 floats of slack after the last row), leaves them as they were and writes
 * them back unchanged. */
INLINE void softmax_rows_vec(float *restrict a, const float *restrict mb, long m_g, long G, long S)
{
    const iN lane = lanes();
    for (long j = 0; j < G; j++) {
        float *restrict r = a + j * S;
        add_mask(r, mb ? mb + j * m_g : NULL, S);
        vN top = (vN){0} - INFINITY;
        for (long s = 0; s < S; s += VL)
            top = selectN(lane < (int32_t)(S - s), selectN(loadN(r + s) > top, loadN(r + s), top), top);
        const float m = max_lanes(top);
        vN sum = (vN){0};
        for (long s = 0; s < S; s += VL) {
            const iN in = lane < (int32_t)(S - s);
            const vN x = loadN(r + s), e = selectN(in, expN(x - m), (vN){0});
            sum += e;
            storeN(r + s, selectN(in, e, x));
        }
        const float inv = 1.f / sum_lanes(sum);
        for (long s = 0; s < S; s++)
            r[s] *= inv;
    }
}

/* lane r of the result = the sum of x[r]'s VL lanes, r < VL: rounds of pairing rows and adding
 * halves (VL - 1 additions for VL sums, where summing each vector alone takes log2(VL) each) */
INLINE vN sum_rows(const vN *x)
{
#if VL == 16
    vN t[8], u[4], w[2];
    for (int r = 0; r < 8; r++) /* lanes 0-7: row r's 8 partial sums, 8-15: row r+8's */
        t[r] = __builtin_shufflevector(x[r], x[r + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(x[r], x[r + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int r = 0; r < 4; r++) /* 4 lanes each: rows r, r+4, r+8, r+12 */
        u[r] = __builtin_shufflevector(t[r], t[r + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + __builtin_shufflevector(t[r], t[r + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int r = 0; r < 2; r++) /* 2 lanes each: rows r, r+2, r+4, ..., r+14 */
        w[r] = __builtin_shufflevector(u[r], u[r + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + __builtin_shufflevector(u[r], u[r + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + __builtin_shufflevector(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
#else
    vN t[4], u[2];
    for (int r = 0; r < 4; r++) /* lanes 0-3: row r's 4 partial sums, 4-7: row r+4's */
        t[r] = __builtin_shufflevector(x[r], x[r + 4], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(x[r], x[r + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int r = 0; r < 2; r++) /* 2 lanes each: rows r, r+2, r+4, r+6 */
        u[r] = __builtin_shufflevector(t[r], t[r + 2], 0, 1, 8, 9, 4, 5, 12, 13)
             + __builtin_shufflevector(t[r], t[r + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 8, 2, 10, 4, 12, 6, 14)
         + __builtin_shufflevector(u[0], u[1], 1, 9, 3, 11, 5, 13, 7, 15);
#endif
}

/* one head, D = 16 n (n a constant where it is inlined: the vectors stay in registers), each of
 * its rows D / VL vectors.  Keys and values go in blocks of VL rows, every query's work done on
 * a block while it is in the core's first cache. */
INLINE void head_vec(const int n, const int bf16, const float *restrict cq, const void *restrict kb, long k_s,
                     const void *restrict vb, long v_s, const void *restrict kn, const float *restrict mb,
                     long m_g, const int64_t *restrict col, float *restrict ob, float *restrict a, long G, long S)
{
    const long D = 16 * n, nv = D / VL;
    for (long s = 0; s < S; s += VL) { /* scores: a block of VL keys' sums in one vector per query */
        const long rows = S - s < VL ? S - s : VL;
        for (long r = 0; r < rows; r++)
            prefetch_row(bf16, kv_at(bf16, vb, KEY(s + r) * v_s), D);
        for (long j = 0; j < G; j++) {
            vN qv[128 / VL], acc[VL];
            for (int i = 0; i < nv; i++)
                qv[i] = loadN(cq + j * D + VL * i);
            for (long r = 0; r < rows; r++) {
                const long row = KEY(s + r) * k_s;
                vN x = qv[0] * kvN(bf16, kb, row);
                for (int i = 1; i < nv; i++)
                    x += qv[i] * kvN(bf16, kb, row + VL * i);
                acc[r] = x;
            }
            if (rows == VL) {
                storeN(a + j * S + s, sum_rows(acc));
            } else { /* the last block: its rows' sums alone (the next query's scores follow them) */
                for (long r = rows; r < VL; r++)
                    acc[r] = (vN){0};
                const vN sums = sum_rows(acc);
                for (long r = 0; r < rows; r++)
                    a[j * S + s + r] = sums[r];
            }
        }
    }
    softmax_rows_vec(a, mb, m_g, G, S);
    for (long d = 0; d < G * D; d++)
        ob[d] = 0.f;
    for (long s = 0; s < S; s += VL) { /* out = A V: a block of VL values into every query's sums */
        const long rows = S - s < VL ? S - s : VL;
        if (kn)
            for (long r = 0; r < rows; r++)
                prefetch_row(bf16, kv_at(bf16, kn, KEY(s + r) * k_s), D);
        for (long j = 0; j < G; j++) {
            const float *restrict p = a + j * S + s;
            vN o0[128 / VL], o1[128 / VL];
            for (int i = 0; i < nv; i++) {
                o0[i] = loadN(ob + j * D + VL * i);
                o1[i] = (vN){0};
            }
            long r = 0;
            for (; r + 2 <= rows; r += 2) { /* two rows into two sets of sums: twice the FMAs in flight */
                const long row0 = KEY(s + r) * v_s, row1 = KEY(s + r + 1) * v_s;
                for (int i = 0; i < nv; i++) {
                    o0[i] += p[r] * kvN(bf16, vb, row0 + VL * i);
                    o1[i] += p[r + 1] * kvN(bf16, vb, row1 + VL * i);
                }
            }
            if (r < rows)
                for (int i = 0; i < nv; i++)
                    o0[i] += p[r] * kvN(bf16, vb, KEY(s + r) * v_s + VL * i);
            for (int i = 0; i < nv; i++)
                storeN(ob + j * D + VL * i, o0[i] + o1[i]);
        }
    }
}
#endif

/* every (b, h): its queries scaled, then head_vec (n = D / 16 > 0) or head_any (n = 0) */
INLINE void all_heads(const int n, const int bf16, const float *restrict q, long q_b, long q_h, long q_g,
                      const void *restrict k, long k_b, long k_h, long k_s, const void *restrict v, long v_b,
                      long v_h, long v_s, const float *restrict mask, long m_b, long m_h, long m_g,
                      const int64_t *restrict columns, long group, float *restrict out, long B, long H, long G, long S,
                      long D, float c, float *restrict a, float *restrict cq)
{
    for (long b = 0; b < B; b++) {
        /* with columns: row b's S keys are rows columns[b, :] of K/V row b / group */
        const int64_t *restrict col = columns ? columns + b * S : NULL;
        const long kv = columns ? b / group : b, kv_next = columns ? (b + 1) / group : b + 1;
        for (long h = 0; h < H; h++) {
            const float *restrict qb = q + b * q_b + h * q_h;
            const void *restrict kb = kv_at(bf16, k, kv * k_b + h * k_h);
            const void *restrict vb = kv_at(bf16, v, kv * v_b + h * v_h);
            const void *restrict kn = h + 1 < H ? kv_at(bf16, kb, k_h) : (b + 1 < B ? kv_at(bf16, k, kv_next * k_b) : NULL);
            const float *restrict mb = mask ? mask + b * m_b + h * m_h : NULL;
            float *restrict ob = out + (b * H + h) * G * D;
            for (long j = 0; j < G; j++)
                for (long d = 0; d < D; d++)
                    cq[j * D + d] = qb[j * q_g + d] * c;
#ifdef S2S_VECTORS
            if (n) {
                head_vec(n, bf16, cq, kb, k_s, vb, v_s, kn, mb, m_g, col, ob, a, G, S);
                continue;
            }
#endif
            head_any(bf16, cq, kb, k_s, vb, v_s, kn, mb, m_g, col, ob, a, G, S, D);
        }
    }
}

int s2s_few_query_attention(const float *q, long q_b, long q_h, long q_g,
                            const void *k, long k_b, long k_h, long k_s,
                            const void *v, long v_b, long v_h, long v_s,
                            const float *mask, long m_b, long m_h, long m_g,
                            const int64_t *columns, long group, long capacity,
                            float *out, long B, long H, long G, long S, long D, float c, int kv_bf16)
{
    for (long i = 0; columns && i < B * S; i++)
        if (columns[i] < 0 || columns[i] >= capacity)
            return -2;
    float *a = malloc(sizeof(float) * (size_t)(G * S + 16)); /* one head's scores, then weights A */
    float *cq = malloc(sizeof(float) * (size_t)(G * D));     /* its queries, times c */
    if (!a || !cq) {
        free(a);
        free(cq);
        return -1;
    }
#define ALL_HEADS(n, bf16) all_heads(n, bf16, q, q_b, q_h, q_g, k, k_b, k_h, k_s, v, v_b, v_h, v_s, mask, m_b, \
                                     m_h, m_g, columns, group, out, B, H, G, S, D, c, a, cq)
#define EACH_DTYPE(n) (kv_bf16 ? ALL_HEADS(n, 1) : ALL_HEADS(n, 0))
    switch (D) {
#ifdef S2S_VECTORS
    case 16: EACH_DTYPE(1); break;
    case 32: EACH_DTYPE(2); break;
    case 48: EACH_DTYPE(3); break; /* the quickstart shape: d_model 192, 4 heads */
    case 64: EACH_DTYPE(4); break;
    case 80: EACH_DTYPE(5); break;
    case 96: EACH_DTYPE(6); break;
    case 112: EACH_DTYPE(7); break;
    case 128: EACH_DTYPE(8); break;
#endif
    default: EACH_DTYPE(0);
    }
#undef EACH_DTYPE
#undef ALL_HEADS
    free(a);
    free(cq);
    return 0;
}

/* ---- a greedy step's choice: the best of each row of scores z over the V target tokens ---- */

#define ARGMAX_BLOCK 512

/* the largest of the scores z[b .. end) (bf16: widened) and whether any is NaN */
INLINE float block_max(const int bf16, const void *restrict zn, long b, long end, int *nan)
{
    float m = -INFINITY;
    long v = b;
#ifdef S2S_VECTORS
    vN mv = (vN){0} - INFINITY;
    iN nv = {0};
    for (; v + VL <= end; v += VL) {
        const vN x = kvN(bf16, zn, v);
        mv = selectN(x > mv, x, mv);
        nv |= x != x;
    }
    for (int l = 0; l < VL; l++) {
        m = mv[l] > m ? mv[l] : m;
        *nan |= nv[l] != 0;
    }
#endif
    for (; v < end; v++) {
        const float x = kv_float(bf16, zn, v);
        m = x > m ? x : m;
        *nan |= x != x;
    }
    return m;
}

/* best[n] = max_v z[n,v] and index[n] = the first v holding it (numpy's and torch's choice on
 * ties; every score -inf: 0), z bf16 (widened as it is read) or fp32, rows z_row elements apart.
 * The maxima of blocks of 512 scores run VL lanes at a time; only the first block reaching the
 * row's maximum is scanned for its position.  Returns 0, or 1 at a row holding NaN (the caller
 * takes its own route). */
INLINE int argmax_rows(const int bf16, const void *z, long z_row, long N, long V, float *best, int64_t *index)
{
    for (long n = 0; n < N; n++) {
        const void *zn = kv_at(bf16, z, n * z_row);
        float top = -INFINITY;
        long top_block = 0;
        int nan = 0;
        for (long b = 0; b < V; b += ARGMAX_BLOCK) {
            const float m = block_max(bf16, zn, b, b + ARGMAX_BLOCK < V ? b + ARGMAX_BLOCK : V, &nan);
            if (m > top) {
                top = m;
                top_block = b;
            }
        }
        if (nan)
            return 1;
        long at = top_block;
        while (at < V - 1 && kv_float(bf16, zn, at) != top)
            at++;
        best[n] = kv_float(bf16, zn, at);
        index[n] = at;
    }
    return 0;
}

int s2s_argmax_rows(const uint16_t *z, long z_row, long N, long V, float *best, int64_t *index)
{
    return argmax_rows(1, z, z_row, N, V, best, index);
}

/* the same over fp32 scores (s2s.native_search's) */
int s2s_argmax_rows_f32(const float *z, long z_row, long N, long V, float *best, int64_t *index)
{
    return argmax_rows(0, z, z_row, N, V, best, index);
}

/* ---- a sampling step's weights: w[v] = e^((z[v] - top) / T) ---- */

/* w[v] = e^((z[v] - top) s) of a row of V fp32 scores (-inf: 0), and their sum: softmax(z s)'s
 * weights (s = 1 / T, a sampling temperature) times e^(-top s), top the row's maximum. */
float s2s_exp_weights(const float *z, long V, float top, float s, float *w)
{
    float sum = 0.f;
    long v = 0;
#ifdef S2S_VECTORS
    vN acc = (vN){0};
    for (; v + VL <= V; v += VL) {
        const vN e = expN((loadN(z + v) - top) * s);
        storeN(w + v, e);
        acc += e;
    }
    sum = sum_lanes(acc);
#endif
    for (; v < V; v++) {
        w[v] = exp_poly((z[v] - top) * s);
        sum += w[v];
    }
    return sum;
}

/* ---- a beam step's log-probabilities: log_softmax(z) = z - shift ---- */

#define SHIFT_BLOCK 64

/* shift = max_v z[v] + log sum_v e^(z[v] - max) of a row of V fp32 scores z, so that
 * log_softmax(z)[v] = z[v] - shift, and each block of 64 scores' maximum ((V + 63) /
 * 64 of them) in tops, by which a beam step passes over the blocks that hold none of its best
 * continuations.  A row of -inf gives -inf; NaN where z holds NaN. */
float s2s_log_softmax_shift(const float *z, long V, float *tops)
{
    float top = -INFINITY;
    int nan = 0;
    for (long b = 0; b < V; b += SHIFT_BLOCK) {
        const float m = block_max(0, z, b, b + SHIFT_BLOCK < V ? b + SHIFT_BLOCK : V, &nan);
        tops[b / SHIFT_BLOCK] = m;
        top = m > top ? m : top;
    }
    if (nan)
        return NAN;
    if (isinf(top))
        return top;
    float sum = 0.f;
    long v = 0;
#ifdef S2S_VECTORS
    vN acc = (vN){0};
    for (; v + VL <= V; v += VL)
        acc += expN(loadN(z + v) - top);
    sum = sum_lanes(acc);
#endif
    for (; v < V; v++)
        sum += exp_poly(z[v] - top);
    return top + logf(sum);
}
