/* Few-query attention for decoding on the CPU: s2s.model.native compiles this file for the
 * machine it runs on (cc -O3 -march=native) and calls it through ctypes.
 *
 *   out[b,h,j,:] = sum_s A[j,s] V[b,h,s,:],   A[j,:] = softmax_s(c q[b,h,j,:] . K[b,h,s,:] + M[b,h,j,s])
 *
 * for the G <= 16 queries of a decoding step (1, or a sentence's beams) against one head's
 * K/V, c = 1/sqrt(D) or 1.  Head by head, the scores read the head's K rows, then the
 * weighted sum its V rows; while one streams in from memory the other is prefetched (V's
 * rows during the scores, the next head's K rows during the sum), where two batched matrix
 * products per step read the cache as B x heads small matrices with no look ahead.
 *
 * Strides are in floats; the last dimension of every tensor is contiguous.  M may be NULL.
 * Returns 0, or -1 where the scores' scratch cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define S2S_VECTORS 1 /* GCC >= 12, clang: 16-float vectors for d_head = 32, 64, 128 */
#endif
#endif

#define INLINE static inline __attribute__((always_inline))

/* e^x = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), |r| <= ln(2) / 2, e^r by
 * Cephes' expf polynomial (within 2 ulp); 0 below ln(FLT_MIN), so e^-inf = 0 as a masked key's
 * weight must be.  Branch-free: the softmax's loop of it vectorizes, where libm's expf is a
 * call per score. */
INLINE float exp_poly(float x)
{
    const float lo = -87.33654475f, hi = 88.37626266f;
    const float xc = x < lo ? lo : (x > hi ? hi : x); /* (not fminf/fmaxf: calls into libm, not vectorized) */
    const float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x < lo ? 0.f : p * two_n;
}

INLINE void prefetch_row(const float *row, long D)
{
    for (long d = 0; d < D; d += 16)
        __builtin_prefetch(row + d, 0, 3);
}

/* A[j,:] = softmax(a[j,:] + M[j,:]) in place, for each query j */
INLINE void softmax_rows(float *restrict a, const float *restrict mb, long m_g, long G, long S)
{
    for (long j = 0; j < G; j++) {
        float *restrict r = a + j * S;
        if (mb) {
            const float *restrict mj = mb + j * m_g;
            for (long s = 0; s < S; s++)
                r[s] += mj[s];
        }
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

/* one head, any D: a[j,s] = cq[j,:] . K[s,:], softmax, out[j,:] = sum_s A[j,s] V[s,:] */
INLINE void head_any(const float *restrict cq, const float *restrict kb, long k_s, const float *restrict vb,
                     long v_s, const float *restrict kn, const float *restrict mb, long m_g, float *restrict ob,
                     float *restrict a, long G, long S, long D)
{
    for (long s = 0; s < S; s++) {
        const float *restrict ks = kb + s * k_s;
        prefetch_row(vb + s * v_s, D);
        for (long j = 0; j < G; j++) {
            const float *restrict qj = cq + j * D;
            float dot = 0.f;
            for (long d = 0; d < D; d++)
                dot += qj[d] * ks[d];
            a[j * S + s] = dot;
        }
    }
    softmax_rows(a, mb, m_g, G, S);
    for (long d = 0; d < G * D; d++)
        ob[d] = 0.f;
    for (long s = 0; s < S; s++) {
        const float *restrict vs = vb + s * v_s;
        if (kn)
            prefetch_row(kn + s * k_s, D);
        for (long j = 0; j < G; j++) {
            const float p = a[j * S + s];
            float *restrict o = ob + j * D;
            for (long d = 0; d < D; d++)
                o[d] += p * vs[d];
        }
    }
}

#ifdef S2S_VECTORS
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias)); /* any float address */

INLINE v16 load16(const float *p) { return *(const v16u *)p; }
INLINE void store16(float *p, v16 x) { *(v16u *)p = x; }

/* lane r of the result = the sum of x[r]'s 16 lanes, r = 0..15: four rounds of pairing rows and
 * adding halves (15 additions for 16 sums, where summing each vector alone takes 4 each) */
INLINE v16 sum_lanes16(const v16 *x)
{
    v16 t[8], u[4], w[2];
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
}

/* one head, D = 16 n (n a constant where it is inlined: the vectors stay in registers).  Keys
 * and values go in blocks of 16 rows, every query's work done on a block while it is in the
 * core's first cache. */
INLINE void head_vec(const int n, const float *restrict cq, const float *restrict kb, long k_s,
                     const float *restrict vb, long v_s, const float *restrict kn, const float *restrict mb,
                     long m_g, float *restrict ob, float *restrict a, long G, long S)
{
    const long D = 16 * n;
    for (long s = 0; s < S; s += 16) { /* scores: a block of 16 keys' sums in one vector per query */
        const long rows = S - s < 16 ? S - s : 16;
        for (long r = 0; r < rows; r++)
            prefetch_row(vb + (s + r) * v_s, D);
        for (long j = 0; j < G; j++) {
            v16 qv[8], acc[16];
            for (int i = 0; i < n; i++)
                qv[i] = load16(cq + j * D + 16 * i);
            for (long r = 0; r < rows; r++) {
                const float *restrict ks = kb + (s + r) * k_s;
                v16 x = qv[0] * load16(ks);
                for (int i = 1; i < n; i++)
                    x += qv[i] * load16(ks + 16 * i);
                acc[r] = x;
            }
            if (rows == 16) {
                store16(a + j * S + s, sum_lanes16(acc));
            } else {
                for (long r = 0; r < rows; r++) {
                    float t = 0.f;
                    for (int l = 0; l < 16; l++)
                        t += acc[r][l];
                    a[j * S + s + r] = t;
                }
            }
        }
    }
    softmax_rows(a, mb, m_g, G, S);
    for (long d = 0; d < G * D; d++)
        ob[d] = 0.f;
    for (long s = 0; s < S; s += 16) { /* out = A V: a block of 16 values into every query's sums */
        const long rows = S - s < 16 ? S - s : 16;
        if (kn)
            for (long r = 0; r < rows; r++)
                prefetch_row(kn + (s + r) * k_s, D);
        for (long j = 0; j < G; j++) {
            const float *restrict p = a + j * S + s;
            v16 o0[8], o1[8];
            for (int i = 0; i < n; i++) {
                o0[i] = load16(ob + j * D + 16 * i);
                o1[i] = (v16){0};
            }
            long r = 0;
            for (; r + 2 <= rows; r += 2) { /* two rows into two sets of sums: twice the FMAs in flight */
                const float *restrict v0 = vb + (s + r) * v_s, *restrict v1 = v0 + v_s;
                for (int i = 0; i < n; i++) {
                    o0[i] += p[r] * load16(v0 + 16 * i);
                    o1[i] += p[r + 1] * load16(v1 + 16 * i);
                }
            }
            if (r < rows)
                for (int i = 0; i < n; i++)
                    o0[i] += p[r] * load16(vb + (s + r) * v_s + 16 * i);
            for (int i = 0; i < n; i++)
                store16(ob + j * D + 16 * i, o0[i] + o1[i]);
        }
    }
}
#endif

/* every (b, h): its queries scaled, then head_vec (n = D / 16 > 0) or head_any (n = 0) */
INLINE void all_heads(const int n, const float *restrict q, long q_b, long q_h, long q_g, const float *restrict k,
                      long k_b, long k_h, long k_s, const float *restrict v, long v_b, long v_h, long v_s,
                      const float *restrict mask, long m_b, long m_h, long m_g, float *restrict out, long B, long H,
                      long G, long S, long D, float c, float *restrict a, float *restrict cq)
{
    for (long b = 0; b < B; b++) {
        for (long h = 0; h < H; h++) {
            const float *restrict qb = q + b * q_b + h * q_h;
            const float *restrict kb = k + b * k_b + h * k_h;
            const float *restrict vb = v + b * v_b + h * v_h;
            const float *restrict kn = h + 1 < H ? kb + k_h : (b + 1 < B ? k + (b + 1) * k_b : NULL);
            const float *restrict mb = mask ? mask + b * m_b + h * m_h : NULL;
            float *restrict ob = out + (b * H + h) * G * D;
            for (long j = 0; j < G; j++)
                for (long d = 0; d < D; d++)
                    cq[j * D + d] = qb[j * q_g + d] * c;
#ifdef S2S_VECTORS
            if (n) {
                head_vec(n, cq, kb, k_s, vb, v_s, kn, mb, m_g, ob, a, G, S);
                continue;
            }
#endif
            head_any(cq, kb, k_s, vb, v_s, kn, mb, m_g, ob, a, G, S, D);
        }
    }
}

int s2s_few_query_attention(const float *q, long q_b, long q_h, long q_g,
                            const float *k, long k_b, long k_h, long k_s,
                            const float *v, long v_b, long v_h, long v_s,
                            const float *mask, long m_b, long m_h, long m_g,
                            float *out, long B, long H, long G, long S, long D, float c)
{
    float *a = malloc(sizeof(float) * (size_t)(G * S + 16)); /* one head's scores, then weights A */
    float *cq = malloc(sizeof(float) * (size_t)(G * D));     /* its queries, times c */
    if (!a || !cq) {
        free(a);
        free(cq);
        return -1;
    }
#define ALL_HEADS(n) all_heads(n, q, q_b, q_h, q_g, k, k_b, k_h, k_s, v, v_b, v_h, v_s, mask, m_b, m_h, m_g, \
                               out, B, H, G, S, D, c, a, cq)
    switch (D) {
#ifdef S2S_VECTORS
    case 32: ALL_HEADS(2); break;
    case 64: ALL_HEADS(4); break;
    case 128: ALL_HEADS(8); break;
#endif
    default: ALL_HEADS(0);
    }
#undef ALL_HEADS
    free(a);
    free(cq);
    return 0;
}
