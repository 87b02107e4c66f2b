/* y = act(x W^T + b) in bf16 for the few rows of a decoding step, on a CPU that multiplies bf16
 * natively: s2s.model.native compiles this file (cc -O3 -march=native) into the library that
 * holds the attention kernel, and native_op.cpp calls it as torch.ops.s2s.bf16_linear.
 *
 * oneDNN's prepacked bf16 product costs about 19 us a call on one thread of an Intel Xeon with
 * AMX whatever its size (a primitive looked up, checked and run), which is most of a step's
 * 64 x 192 x 192 product: a greedy step of the quickstart model makes 13 of them.  Here W is
 * packed once into the pairs layout both of the CPU's bf16 instructions read,
 *
 *   P[nb][kb][p][n][j] = W[16 nb + n][32 kb + 2 p + j],   n, p < 16, j < 2  (zeros past N and K),
 *
 * (16 x 32 of W, 1 KiB: one AMX tile, or 16 rows of 16 column pairs for AVX512-BF16's
 * vdpbf16ps), and a call multiplies, adds b, applies the activation and rounds to bf16 (to
 * nearest, ties to even) with no more than a function call's overhead.  Every sum is in fp32.
 *
 * AMX (amx_bf16): 16 x 32 tiles of x times a tile of P into 16 x 16 fp32 sums, four of them
 * (32 rows x 32 columns of y) per pass over K.  AVX512-BF16 (avx512_bf16, no AMX: AMD's Zen
 * 4 and 5): 4 rows x 32 columns of sums in registers, a pair of x broadcast against 16
 * columns' pairs per instruction.  s2s_bf16_linear_isa() says which this library runs (0:
 * neither, and the caller takes oneDNN's route).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define S2S_AVX512_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define S2S_AMX 1
#endif
#endif

enum { ISA_NONE = 0, ISA_AVX512_BF16 = 1, ISA_AMX = 2 };
enum { ACT_NONE = 0, ACT_RELU = 1 };

#ifdef S2S_AMX
/* Linux lends a process the tiles' 8 KiB of state only once asked (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XTILEDATA); 1 where it granted them. */
static int amx_granted(void)
{
    static int granted = -1;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
}
#endif

static int isa_cap = ISA_AMX; /* s2s_bf16_linear_cap_isa: the best kernel a caller lets this library take */

int s2s_bf16_linear_isa(void)
{
#ifdef S2S_AMX
    if (isa_cap >= ISA_AMX && amx_granted())
        return ISA_AMX;
#endif
#ifdef S2S_AVX512_BF16
    if (isa_cap >= ISA_AVX512_BF16)
        return ISA_AVX512_BF16;
#endif
    return ISA_NONE;
}

/* Take no kernel better than ``isa`` (ISA_*) from now on: an AMX CPU runs (and tests) the
 * AVX512-BF16 kernel that AMD's CPUs take.  Returns the cap it replaces. */
int s2s_bf16_linear_cap_isa(int isa)
{
    const int was = isa_cap;
    isa_cap = isa;
    return was;
}

/* The packed size in bf16 elements of a W (N, K): ceil(N/16) ceil(K/32) blocks of 512. */
long s2s_bf16_packed_size(long N, long K)
{
    return ((N + 15) / 16) * ((K + 31) / 32) * 512;
}

/* P (the layout above) from W (N, K) bf16, rows w_row elements apart. */
void s2s_bf16_pack(const uint16_t *W, long w_row, long N, long K, uint16_t *P)
{
    const long KB = (K + 31) / 32;
    for (long nb = 0; nb < (N + 15) / 16; nb++)
        for (long kb = 0; kb < KB; kb++) {
            uint16_t *tile = P + (nb * KB + kb) * 512;
            for (long p = 0; p < 16; p++)
                for (long n = 0; n < 16; n++)
                    for (long j = 0; j < 2; j++) {
                        const long row = 16 * nb + n, col = 32 * kb + 2 * p + j;
                        tile[(p * 16 + n) * 2 + j] = row < N && col < K ? W[row * w_row + col] : 0;
                    }
        }
}

#ifdef S2S_AVX512_BF16
/* bf16 of 16 fp32 (to nearest, ties to even; NaN stays NaN) */
static inline __m256i round16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

static inline __m512 widen16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* y[r, n0 .. n0 + cols) = act(sums[r, :] + b) in bf16, for r < rows; sums rows 16 apart */
static inline void finish(const float *sums, long rows, long cols, const uint16_t *b, int act, uint16_t *y,
                          long y_row, long n0)
{
    const __mmask16 keep = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __m512 bias = b ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, b + n0)), 16))
                          : _mm512_setzero_ps();
    for (long r = 0; r < rows; r++) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + 16 * r), bias);
        if (act == ACT_RELU)
            v = _mm512_max_ps(v, _mm512_setzero_ps());
        _mm256_mask_storeu_epi16(y + r * y_row + n0, keep, round16(v));
    }
}
#endif

#ifdef S2S_AMX
#define CHUNK_NB 16 /* (even: the blocks go in pairs) */

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tiles 0, 1: sums of rows m .. m + 15 and m + 16 .. m + 31 times columns n .. n + 15; 2, 3: the
 * same times n + 16 .. n + 31; 4, 5: x's two row blocks; 6, 7: P's two column blocks */
static void configure(long rows0, long rows1)
{
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++)
        c.colsb[t] = 64;
    c.rows[0] = c.rows[2] = c.rows[4] = (uint8_t)rows0;
    c.rows[1] = c.rows[3] = c.rows[5] = (uint8_t)(rows1 > 0 ? rows1 : 1);
    c.rows[6] = c.rows[7] = 16;
    _tile_loadconfig(&c);
}

static void linear_amx(const uint16_t *x, long x_row, long M, long N, long K, const uint16_t *P, const uint16_t *b,
                       int act, uint16_t *y, long y_row)
{
    const long KB = K / 32, NB = (N + 15) / 16;
    float sums[4][16 * 16] __attribute__((aligned(64)));
    long configured0 = -1, configured1 = -1;
    /* W's columns in chunks of CHUNK_NB blocks (256 columns: 128 KiB of P at K = 256), each
     * multiplied by every block of rows while it is in the core's second cache: a wide W (an
     * output projection) read once from memory, not once per 32 rows */
    for (long n0 = 0; n0 < NB; n0 += CHUNK_NB)
    for (long m = 0; m < M; m += 32) {
        const long rows0 = M - m < 16 ? M - m : 16, rows1 = M - m - 16 < 16 ? M - m - 16 : 16;
        if (rows0 != configured0 || rows1 != configured1) { /* (a partial last block of rows: twice a chunk) */
            configure(rows0, rows1);
            configured0 = rows0, configured1 = rows1;
        }
        const uint16_t *x0 = x + m * x_row, *x1 = x0 + 16 * x_row;
        for (long nb = n0; nb < NB && nb < n0 + CHUNK_NB; nb += 2) {
            const int two = nb + 1 < NB;
            const uint16_t *p0 = P + nb * KB * 512, *p1 = p0 + KB * 512;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (long kb = 0; kb < KB; kb++) {
                _tile_loadd(4, x0 + 32 * kb, x_row * 2);
                _tile_loadd(6, p0 + kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (rows1 > 0) {
                    _tile_loadd(5, x1 + 32 * kb, x_row * 2);
                    _tile_dpbf16ps(1, 5, 6);
                }
                if (two) {
                    _tile_loadd(7, p1 + kb * 512, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    if (rows1 > 0)
                        _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, sums[0], 64);
            finish(sums[0], rows0, N - 16 * nb, b, act, y + m * y_row, y_row, 16 * nb);
            if (rows1 > 0) {
                _tile_stored(1, sums[1], 64);
                finish(sums[1], rows1, N - 16 * nb, b, act, y + (m + 16) * y_row, y_row, 16 * nb);
            }
            if (two) {
                _tile_stored(2, sums[2], 64);
                finish(sums[2], rows0, N - 16 * (nb + 1), b, act, y + m * y_row, y_row, 16 * (nb + 1));
                if (rows1 > 0) {
                    _tile_stored(3, sums[3], 64);
                    finish(sums[3], rows1, N - 16 * (nb + 1), b, act, y + (m + 16) * y_row, y_row, 16 * (nb + 1));
                }
            }
        }
    }
    _tile_release();
}
#endif

#ifdef S2S_AVX512_BF16
/* rows m .. m + R - 1 (R <= 4) times column blocks nb, nb + 1 (C = 1 or 2 of them) */
static inline void block_avx512(const uint16_t *x, long x_row, long R, long C, long K, long KB, const uint16_t *P,
                                long nb, float sums[4][2][16])
{
    __m512 acc[4][2];
    for (int r = 0; r < 4; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (long kb = 0; kb < KB; kb++) {
        const uint16_t *t0 = P + (nb * KB + kb) * 512, *t1 = t0 + KB * 512;
        for (long p = 0; p < 16 && 32 * kb + 2 * p < K; p++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(t0 + 32 * p);
            const __m512bh w1 = C > 1 ? (__m512bh)_mm512_loadu_si512(t1 + 32 * p) : w0;
            const long k = 32 * kb + 2 * p;
            for (int r = 0; r < 4; r++) {
                if (r >= R)
                    break;
                uint32_t pair;
                if (k + 1 < K) {
                    memcpy(&pair, x + r * x_row + k, 4);
                } else {
                    pair = x[r * x_row + k]; /* K odd: the last element with a zero beside it */
                }
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
                if (C > 1)
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            }
        }
    }
    for (int r = 0; r < 4; r++) {
        _mm512_storeu_ps(sums[r][0], acc[r][0]);
        _mm512_storeu_ps(sums[r][1], acc[r][1]);
    }
}

static void linear_avx512(const uint16_t *x, long x_row, long M, long N, long K, const uint16_t *P, const uint16_t *b,
                          int act, uint16_t *y, long y_row)
{
    const long KB = (K + 31) / 32, NB = (N + 15) / 16;
    float sums[4][2][16] __attribute__((aligned(64)));
    float one[16 * 4] __attribute__((aligned(64)));
    for (long m = 0; m < M; m += 4) {
        const long R = M - m < 4 ? M - m : 4;
        for (long nb = 0; nb < NB; nb += 2) {
            const long C = nb + 1 < NB ? 2 : 1;
            block_avx512(x + m * x_row, x_row, R, C, K, KB, P, nb, sums);
            for (long c = 0; c < C; c++) {
                for (long r = 0; r < R; r++)
                    memcpy(one + 16 * r, sums[r][c], sizeof sums[r][c]);
                finish(one, R, N - 16 * (nb + c), b, act, y + m * y_row, y_row, 16 * (nb + c));
            }
        }
    }
}
#endif

/* y (M, N) = act(x W^T + b), x (M, K) bf16 rows x_row apart, P packed from W (N, K), b NULL or
 * (N) bf16, y rows y_row apart.  Returns 0, or -1 where this library has no bf16 kernel (or,
 * for AMX, K is not a multiple of 32: the caller takes oneDNN's route). */
int s2s_bf16_linear(const uint16_t *x, long x_row, long M, long N, long K, const uint16_t *P, const uint16_t *b,
                    int act, uint16_t *y, long y_row)
{
    const int isa = s2s_bf16_linear_isa();
#ifdef S2S_AMX
    if (isa == ISA_AMX && K % 32 == 0) {
        linear_amx(x, x_row, M, N, K, P, b, act, y, y_row);
        return 0;
    }
#endif
#ifdef S2S_AVX512_BF16
    if (isa != ISA_NONE) {
        linear_avx512(x, x_row, M, N, K, P, b, act, y, y_row);
        return 0;
    }
#endif
    (void)x, (void)x_row, (void)M, (void)N, (void)K, (void)P, (void)b, (void)act, (void)y, (void)y_row, (void)isa;
    return -1;
}
