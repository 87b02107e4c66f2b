/* y = act(x W^T + b) with int8 products, for the torch-free search (native_search.c): its
 * ``--precision auto`` on CPUs with AVX2 but not AMX (s2s.native_search.products_for), and
 * ``--quantize int8`` on any CPU with AVX2.  x and y are bf16, as native_linear.c's products take
 * and give them, so that the search runs either.
 *
 * W is quantized once, row by row (symmetric, 8 bits), and each call quantizes x row by row
 * (asymmetric, 7 bits: a ReLU's outputs and a norm's use the whole range):
 *
 *   q(W)[n] = round(W[n] / s_W[n]),  s_W[n] = max_k |W[n][k]| / 127           (-127 .. 127)
 *   u(x)[r] = round(x[r] / s_x[r]) + z[r],  s_x[r] = (max(x[r], 0) - min(x[r], 0)) / 127,
 *             z[r] = round(-min(x[r], 0) / s_x[r])                             (0 .. 127)
 *   y[r][n] = s_x[r] s_W[n] (sum_k u(x)[r][k] q(W)[n][k] - z[r] c[n]) + b[n],  c[n] = sum_k q(W)[n][k]
 *
 * the sums exact in int32 (K < 133,000).  AVX2's vpmaddubsw multiplies unsigned bytes by signed
 * bytes and adds each two products into 16 bits with saturation; 7-bit u keeps two products
 * within 2 x 127 x 127 = 32,258, so nothing saturates (the reason torch's fbgemm quantizes x to
 * 7 bits on x86 too); vpmaddwd by ones adds the 16-bit pairs into int32.  Where the CPU has VNNI
 * (AVX512-VNNI, AVX-VNNI), one vpdpbusd adds each 4 products into int32 instead: the same sums,
 * so that a model translates alike on either (u stays 7-bit there too).  W is packed
 *
 *   Q[nb][k4][h][n][j] = q(W)[16 nb + 8 h + n][4 k4 + j],   h < 2, n < 8, j < 4  (zeros past N),
 *
 * so that one 32-byte load holds 4 depths of 8 columns and a row's 4 bytes broadcast meet them;
 * s_W and c precede it.  A block of ROWS rows x 16 columns (8 rows with AVX-512's 32 registers, 4
 * with AVX2's 16) keeps its sums in registers for the whole depth, W's columns in chunks of
 * CHUNK_BYTES multiplied by every block of rows while they are in the core's second cache.
 * (benchmarks/README.md, one core of an AMD EPYC Zen 4, x's quantization and the store included, W rotated past
 * the caches, benchmarks/native_kernels.py --products: from 64 rows up 79-97 GMAC/s built for AVX2
 * alone, 130-180 with vpdpbusd on 8 rows; vdpbf16ps 90-104.)
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define S2S_I8_AVX2 1
#endif

void *s2s_thread_block(int which, size_t bytes); /* native_thread.c */
enum { S2S_BLOCK_PRODUCTS = 1 };                  /* its block for the products' quantized rows */

#ifndef I8_ROWS /* rows of a block: 2 x ROWS sums, two columns' halves and a row's bytes in registers */
#ifdef __AVX512VL__
#define I8_ROWS 8 /* (AVX-512's 32 vector registers) */
#else
#define I8_ROWS 4 /* (AVX2's 16) */
#endif
#endif
_Static_assert(I8_ROWS >= 4 && I8_ROWS <= 8, "I8_ROWS: linear_i8's cases cover blocks of 4 to 8 rows");
#ifndef I8_CHUNK_BYTES
#define I8_CHUNK_BYTES (128 * 1024)
#endif
enum { ACT_NONE = 0, ACT_RELU = 1 };

/* which instructions this library's kernel runs: 2 VNNI's vpdpbusd, 1 AVX2's (it was built for a
 * CPU with AVX2 and FMA, no VNNI), 0 none (no kernel) */
int s2s_i8_linear_available(void)
{
#if defined(S2S_I8_AVX2) && (defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__))
    return 2;
#elif defined(S2S_I8_AVX2)
    return 1;
#else
    return 0;
#endif
}

static inline long blocks16(long N) { return (N + 15) / 16; }

/* bytes of Q for W (N, K): s_W and c for 16 columns a block, then the packed bytes */
long s2s_i8_packed_bytes(long N, long K)
{
    return blocks16(N) * 16 * ((long)(sizeof(float) + sizeof(int32_t)) + K);
}

/* q(W) (N, K) int8 row by row, and each row's scale s_W (above), from fp32 W; a row holding NaN
 * gets the scale NaN (its outputs NaN, as the bf16 products give them) */
void s2s_i8_quantize_rows(const float *W, long N, long K, int8_t *Wq, float *scale)
{
    for (long n = 0; n < N; n++) {
        const float *w = W + n * K;
        float top = 0.0f;
        int nan = 0;
        for (long k = 0; k < K; k++) {
            top = fabsf(w[k]) > top ? fabsf(w[k]) : top;
            nan |= w[k] != w[k];
        }
        const float s = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
        for (long k = 0; k < K; k++) {
            float v = nearbyintf(w[k] * inv);
            v = v == v ? v : 0.0f; /* (NaN, or inf times 0: not a number to convert) */
            Wq[n * K + k] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
        scale[n] = nan ? NAN : s;
    }
}

/* Q (above) of rows ids[0 .. N) of q(W) (rows K apart) with their scales, or of rows 0 .. N where
 * ids is NULL (a batch's shortlist, or the whole matrix); K a multiple of 4 */
void s2s_i8_pack(const int8_t *Wq, const float *scale, const int32_t *ids, long N, long K, void *Q)
{
    const long NB = blocks16(N), K4 = K / 4;
    float *s = Q;
    int32_t *c = (int32_t *)(s + NB * 16);
    int8_t *q = (int8_t *)(c + NB * 16);
    memset(Q, 0, (size_t)s2s_i8_packed_bytes(N, K));
    for (long n = 0; n < N; n++) {
        const long row = ids ? ids[n] : n, nb = n / 16, h = n % 16 / 8, n8 = n % 8;
        const int8_t *w = Wq + row * K;
        int32_t sum = 0;
        for (long k = 0; k < K; k++) {
            q[((nb * K4 + k / 4) * 2 + h) * 32 + n8 * 4 + k % 4] = w[k];
            sum += w[k];
        }
        s[n] = scale[row];
        c[n] = sum;
    }
}

#ifdef S2S_I8_AVX2
/* bf16 (8) widened to fp32 */
static inline __m256 widen8(const uint16_t *h)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
}

/* u(x) of M rows (bytes, K apart), s_x and z (above).  A row whose range is below X_TINY (every
 * |x| under about 1e-28, where 1 / s_x would overflow) is taken as zeros; a row holding NaN or an
 * infinity gets s_x NaN, so that its outputs are NaN as the bf16 products' are (the search stops
 * on them). */
#define X_TINY 0x1p-100f
static void quantize_x(const uint16_t *x, long x_row, long M, long K, uint8_t *u, float *s_x, int32_t *z)
{
    for (long r = 0; r < M; r++) {
        const uint16_t *xr = x + r * x_row;
        uint8_t *ur = u + r * K;
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (long k = 0; k < K; k += 8) {
            const __m256 v = widen8(xr + k);
            lo = _mm256_min_ps(lo, v);
            hi = _mm256_max_ps(hi, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float l[8], h[8], low = 0.0f, high = 0.0f;
        _mm256_storeu_ps(l, lo);
        _mm256_storeu_ps(h, hi);
        for (int i = 0; i < 8; i++) {
            low = l[i] < low ? l[i] : low;
            high = h[i] > high ? h[i] : high;
        }
        const float range = (high - low) / 127.0f, s = range >= X_TINY ? range : 0.0f;
        if (_mm256_movemask_ps(nan) || !(range <= FLT_MAX)) { /* (an infinity: its outputs are not numbers either) */
            s_x[r] = NAN, z[r] = 0;
            memset(ur, 0, (size_t)K);
            continue;
        }
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        const float zero = s > 0.0f ? nearbyintf(-low * inv) : 0.0f;
        s_x[r] = s;
        z[r] = (int32_t)zero;
        const __m256 vinv = _mm256_set1_ps(inv), vz = _mm256_set1_ps(zero);
        const __m256 top = _mm256_set1_ps(127.0f), bottom = _mm256_setzero_ps();
        for (long k = 0; k < K; k += 8) {
            __m256 v = _mm256_add_ps(_mm256_round_ps(_mm256_mul_ps(widen8(xr + k), vinv),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
            v = _mm256_min_ps(_mm256_max_ps(v, bottom), top);
            const __m256i i32 = _mm256_cvtps_epi32(v);
            const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i *)(ur + k), _mm_packus_epi16(i16, i16));
        }
    }
}

/* bf16 of 8 fp32 (to nearest, ties to even; NaN stays NaN) */
static inline __m128i round8(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
}

/* acc + the sums of each 4 products of unsigned u and signed q bytes, lane by lane: one vpdpbusd
 * where the CPU has VNNI (AVX512-VNNI with VL, or AVX-VNNI), else AVX2's vpmaddubsw (pairs into 16
 * bits, exact for 7-bit u) and vpmaddwd by ones (pairs of those into 32) -- the same int32 sums */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, q) _mm256_dpbusd_epi32(acc, u, q)
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, q) _mm256_dpbusd_avx_epi32(acc, u, q)
#else
#define DPBUSD(acc, u, q) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1)))
#endif

/* sums[r][0 .. 16) = sum_k u[r][k] q[n][k] for R rows of u (K apart) and one block of 16 columns */
static inline __attribute__((always_inline)) void i8_block(const int R, const uint8_t *u, long K, const int8_t *q,
                                                           __m256i sums[][2])
{
    __m256i acc[I8_ROWS][2];
    for (int r = 0; r < R; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (long k4 = 0; k4 < K / 4; k4++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + k4 * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(q + k4 * 64 + 32));
        for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, u + r * K + 4 * k4, sizeof quad);
            const __m256i xr = _mm256_set1_epi32(quad);
            acc[r][0] = DPBUSD(acc[r][0], xr, w0);
            acc[r][1] = DPBUSD(acc[r][1], xr, w1);
        }
    }
    for (int r = 0; r < R; r++)
        sums[r][0] = acc[r][0], sums[r][1] = acc[r][1];
}

/* y[r][n0 ..] of R rows from their sums: s_x s_W (sums - z c) + b, act, bf16 (or fp32 into y32) */
static void finish(long R, __m256i sums[][2], const float *s_x, const int32_t *z, const float *s_w,
                   const int32_t *c, const uint16_t *b, int act, uint16_t *y, float *y32, long y_row, long n0,
                   long cols)
{
    for (int h = 0; h < 2 && 8 * h < cols; h++) {
        const long n = n0 + 8 * h, width = cols - 8 * h < 8 ? cols - 8 * h : 8;
        const __m256 sw = _mm256_loadu_ps(s_w + n);
        const __m256i cn = _mm256_loadu_si256((const __m256i *)(c + n));
        __m256 bias = _mm256_setzero_ps();
        if (b) {
            uint16_t b8[8] = {0};
            memcpy(b8, b + n, sizeof(uint16_t) * (size_t)width);
            bias = widen8(b8);
        }
        for (long r = 0; r < R; r++) {
            const __m256i exact = _mm256_sub_epi32(sums[r][h], _mm256_mullo_epi32(_mm256_set1_epi32(z[r]), cn));
            __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(_mm256_set1_ps(s_x[r]), sw), bias);
            if (act == ACT_RELU)
                v = _mm256_max_ps(v, _mm256_setzero_ps());
            if (y32 && width == 8) {
                _mm256_storeu_ps(y32 + r * y_row + n, v);
            } else if (y32) {
                float t[8];
                _mm256_storeu_ps(t, v);
                memcpy(y32 + r * y_row + n, t, sizeof(float) * (size_t)width);
            } else if (width == 8) {
                _mm_storeu_si128((__m128i *)(y + r * y_row + n), round8(v));
            } else {
                uint16_t t[8];
                _mm_storeu_si128((__m128i *)t, round8(v));
                memcpy(y + r * y_row + n, t, sizeof(uint16_t) * (size_t)width);
            }
        }
    }
}

#define I8_CASE(R)                                                                                             \
    case R:                                                                                                    \
        i8_block(R, u + m * K, K, q + nb * K * 16, sums);                                                       \
        break;

static int linear_i8(const uint16_t *x, long x_row, long M, long N, long K, const void *Q, const uint16_t *b,
                     int act, uint16_t *y, float *y32, long y_row)
{
    if (M <= 0)
        return 0;
    const long NB = blocks16(N);
    const float *s_w = Q;
    const int32_t *c = (const int32_t *)(s_w + NB * 16);
    const int8_t *q = (const int8_t *)(c + NB * 16);
    const long bytes = M * (K + (long)(sizeof(float) + sizeof(int32_t)));
    uint8_t *block = s2s_thread_block(S2S_BLOCK_PRODUCTS, (size_t)bytes);
    if (!block)
        return -4;
    float *s_x = (float *)block;
    int32_t *z = (int32_t *)(s_x + M);
    uint8_t *u = (uint8_t *)(z + M);
    quantize_x(x, x_row, M, K, u, s_x, z);
    long chunk = I8_CHUNK_BYTES / (16 * K);
    chunk = chunk < 1 ? 1 : chunk;
    for (long n0 = 0; n0 < NB; n0 += chunk)
        for (long m = 0; m < M; m += I8_ROWS)
            for (long nb = n0; nb < NB && nb < n0 + chunk; nb++) {
                const long R = M - m < I8_ROWS ? M - m : I8_ROWS;
                __m256i sums[I8_ROWS][2];
                switch (R) {
                    I8_CASE(1) I8_CASE(2) I8_CASE(3)
#if I8_ROWS > 4
                    I8_CASE(4) I8_CASE(5)
#endif
#if I8_ROWS > 6
                    I8_CASE(6) I8_CASE(7)
#endif
                    default: i8_block(I8_ROWS, u + m * K, K, q + nb * K * 16, sums);
                }
                finish(R, sums, s_x + m, z + m, s_w, c, b, act, y ? y + m * y_row : NULL,
                       y32 ? y32 + m * y_row : NULL, y_row, 16 * nb, N - 16 * nb < 16 ? N - 16 * nb : 16);
            }
    return 0;
}
#undef I8_CASE
#endif

/* y (M, N) = act(x W^T + b) in bf16 (or in fp32 into y32 where it is not NULL: the sums not
 * rounded), x (M, K) bf16 rows x_row apart, Q packed by s2s_i8_pack from W (N, K), b NULL or (N)
 * bf16, y rows y_row apart; K a multiple of 8.  Returns 0; -1 where this library has no kernel
 * (s2s_i8_linear_available), -2 where K is not a multiple of 8, -4 where its scratch could not be
 * allocated. */
int s2s_i8_linear(const uint16_t *x, long x_row, long M, long N, long K, const void *Q, const uint16_t *b, int act,
                  uint16_t *y, float *y32, long y_row)
{
    if (K % 8)
        return -2;
#ifdef S2S_I8_AVX2
    return linear_i8(x, x_row, M, N, K, Q, b, act, y, y32, y_row);
#else
    (void)x, (void)x_row, (void)M, (void)N, (void)Q, (void)b, (void)act, (void)y, (void)y32, (void)y_row;
    return -1;
#endif
}
