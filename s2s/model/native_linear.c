/* y = act(x W^T + b) in bf16 for the few rows of a decoding step, on a CPU with AMX or with
 * AVX512-BF16: s2s.model.native compiles this file (cc -O3 -march=native) into the library that
 * holds the attention kernel, native_op.cpp calls it as torch.ops.s2s.bf16_linear, and
 * native_search.c makes every product of its torch-free search with it.
 *
 * oneDNN's prepacked bf16 product costs about 19 us a call on one thread of an Intel Xeon with
 * AMX whatever its size (a primitive looked up, checked and run), which is most of a step's
 * 64 x 192 x 192 product: a greedy step of the quickstart model makes 13 of them.  Here W is
 * packed once into the pairs layout of AMX's B tiles,
 *
 *   P[nb][kb][p][n][j] = W[16 nb + n][32 kb + 2 p + j],   n, p < 16, j < 2  (zeros past N and K),
 *
 * (16 x 32 of W, 1 KiB a tile), and a call multiplies 16 x 32 tiles of x by P's tiles into
 * 16 x 16 fp32 sums, four of them (32 rows x 32 columns of y) per pass over K, then adds b,
 * applies the activation and rounds to bf16 (to nearest, ties to even), with no more than a
 * function call's overhead.  Every sum is in fp32.  K must be a multiple of 32 (a tile's
 * depth; s2s.model.gemm leaves other matrices to oneDNN).
 *
 * Without AMX (AMD's Zen 4 and 5, Intel's Cooper Lake) the same P is read by AVX512-BF16's
 * vdpbf16ps: one row p of a tile is 64 bytes, the pairs (W[n][2p], W[n][2p + 1]) of 16 columns,
 * which one instruction multiplies by a row's pair (x[2p], x[2p + 1]) broadcast, adding each
 * column's two products to its fp32 sum in the order AMX adds them.  A block of 6 rows x 64
 * columns keeps its 24 sums in registers for the whole depth.  s2s_bf16_linear_isa() says which
 * kernel this library and this process run.  (A third kernel, for any other CPU, widened each
 * bf16 pair to two fp32 on vectors of 8 floats: 30 GMAC/s on AVX2's registers of a Zen 4, and the
 * torch-free search on it ran at 0.45-0.50x CTranslate2 int8 on the same instructions, so it was
 * not kept: those CPUs take int8 products, native_int8.c.  benchmarks/README.md.)  (On the AMX Xeon the torch
 * route's products measured this kernel as fast as oneDNN's greedy and 4% slower at beam 5: that
 * route keeps oneDNN without AMX, s2s.model.gemm.)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define S2S_AVX512BF16 1
#if defined(__linux__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define S2S_AMX 1
#endif
#endif

#define CHUNK_NB 16 /* W's column blocks multiplied by every row before the next (even: they go in pairs) */
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

enum { ISA_NONE = 0, ISA_AMX = 1, ISA_AVX512BF16 = 2 };

/* the kernels this library has and this process may run: 1 << ISA_AMX where it has the AMX
 * kernel and Linux lent the process the tiles, 1 << ISA_AVX512BF16 where it has vdpbf16ps's */
static int isa_available(void)
{
    int have = 0;
#ifdef S2S_AVX512BF16
    have |= 1 << ISA_AVX512BF16;
#endif
#ifdef S2S_AMX
    if (amx_granted())
        have |= 1 << ISA_AMX;
#endif
    return have;
}

static int isa_chosen = -1; /* the kernel every product runs: the best available, or s2s_bf16_linear_use's */

/* Which kernel the products run: 1 AMX, 2 AVX512-BF16 (vdpbf16ps), 0 none (this library was built
 * without either, or the CPU has neither). */
int s2s_bf16_linear_isa(void)
{
    if (isa_chosen < 0) {
        const int have = isa_available();
        isa_chosen = have & (1 << ISA_AMX) ? ISA_AMX : have & (1 << ISA_AVX512BF16) ? ISA_AVX512BF16 : ISA_NONE;
    }
    return isa_chosen;
}

/* Run the products with kernel ``isa`` (as s2s_bf16_linear_isa numbers them; 0: the best this
 * process has) from now on, as tests do to check each kernel on a CPU that has both.  Returns
 * the kernel in effect, which is the one asked for unless the process cannot run it. */
int s2s_bf16_linear_use(int isa)
{
    isa_chosen = -1;
    if (isa > 0 && isa_available() & (1 << isa))
        isa_chosen = isa;
    return s2s_bf16_linear_isa();
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

#ifdef S2S_AVX512BF16
/* bf16 of 16 fp32 (to nearest, ties to even; NaN stays NaN) */
static inline __m256i round16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

/* the first min(cols, 16) of 16 lanes */
static inline __mmask16 keep16(long cols) { return cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1); }

/* b[n0 .. n0 + 16) widened to fp32 (the lanes of ``keep``; 0 for b NULL) */
static inline __m512 bias16(const uint16_t *b, long n0, __mmask16 keep)
{
    return b ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, b + n0)), 16))
             : _mm512_setzero_ps();
}

/* 16 outputs of a row: act(sums + bias) in bf16 at y, or in fp32 at y32 where it is not NULL */
static inline void store16(__m512 sums, __m512 bias, int act, __mmask16 keep, uint16_t *y, float *y32)
{
    __m512 v = _mm512_add_ps(sums, bias);
    if (act == ACT_RELU)
        v = _mm512_max_ps(v, _mm512_setzero_ps());
    if (y32)
        _mm512_mask_storeu_ps(y32, keep, v);
    else
        _mm256_mask_storeu_epi16(y, keep, round16(v));
}

/* y[r, n0 .. n0 + cols) = act(sums[r, :] + b) in bf16 (or in fp32 into y32 where it is not NULL),
 * for r < rows; sums rows 16 apart */
static inline void finish(const float *sums, long rows, long cols, const uint16_t *b, int act, uint16_t *y,
                          float *y32, long y_row, long n0)
{
    const __mmask16 keep = keep16(cols);
    const __m512 bias = bias16(b, n0, keep);
    for (long r = 0; r < rows; r++)
        store16(_mm512_loadu_ps(sums + 16 * r), bias, act, keep, y ? y + r * y_row + n0 : NULL,
                y32 ? y32 + r * y_row + n0 : NULL);
}

#define DP_ROWS 6 /* a block of rows x DP_COLS blocks of 16 columns: 24 fp32 sums in registers */
#define DP_COLS 4

/* y[r, n0 + 16 c ..] for r < R, c < C (R, C constants where inlined): sum over the depth of
 * x's pairs broadcast times P's rows of pairs (row k2 of the depth in pairs lies k2 * 32 elements
 * into each tile column block, whose blocks are KB * 512 apart), then bias, activation, store */
static inline __attribute__((always_inline)) void dp_block(const int R, const int C, const uint16_t *x, long x_row,
                                                           long K, const uint16_t *P, long KB, const uint16_t *b,
                                                           int act, uint16_t *y, float *y32, long y_row, long n0,
                                                           long N)
{
    __m512 acc[DP_ROWS][DP_COLS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm512_setzero_ps();
    for (long k2 = 0; k2 < K / 2; k2++) {
        __m512bh w[DP_COLS];
        for (int c = 0; c < C; c++)
            w[c] = (__m512bh)_mm512_loadu_si512(P + c * KB * 512 + k2 * 32);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_row + 2 * k2, sizeof pair);
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < C; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xr, w[c]);
        }
    }
    for (int c = 0; c < C; c++) {
        const long col = n0 + 16 * c, cols = N - col;
        const __mmask16 keep = keep16(cols);
        const __m512 bias = bias16(b, col, keep);
        for (int r = 0; r < R; r++)
            store16(acc[r][c], bias, act, keep, y ? y + r * y_row + col : NULL, y32 ? y32 + r * y_row + col : NULL);
    }
}

#define DP_CASE(R, C)                                                                                  \
    case (R) * 8 + (C):                                                                                \
        dp_block(R, C, x + m * x_row, x_row, K, P + nb * KB * 512, KB, b, act, y ? y + m * y_row : NULL, \
                 y32 ? y32 + m * y_row : NULL, y_row, 16 * nb, N);                                     \
        break;
#define DP_ROW_CASES(R) DP_CASE(R, 1) DP_CASE(R, 2) DP_CASE(R, 3) DP_CASE(R, 4)

/* linear_amx's product with vdpbf16ps: W's columns in chunks, each multiplied by every block of
 * DP_ROWS rows while it is in the core's second cache; a chunk is DP_CHUNK_BYTES of P (K x 16
 * columns x 2 bytes a block), so that it and the rows fit there together */
#ifndef DP_CHUNK_BYTES
#define DP_CHUNK_BYTES (128 * 1024)
#endif
static void linear_dp(const uint16_t *x, long x_row, long M, long N, long K, const uint16_t *P, const uint16_t *b,
                      int act, uint16_t *y, float *y32, long y_row)
{
    const long KB = K / 32, NB = (N + 15) / 16;
    long chunk = DP_CHUNK_BYTES / (32 * K) / DP_COLS * DP_COLS;
    chunk = chunk < DP_COLS ? DP_COLS : chunk;
    for (long n0 = 0; n0 < NB; n0 += chunk)
        for (long m = 0; m < M; m += DP_ROWS)
            for (long nb = n0; nb < NB && nb < n0 + chunk; nb += DP_COLS) {
                const long R = M - m < DP_ROWS ? M - m : DP_ROWS;
                const long end = NB < n0 + chunk ? NB : n0 + chunk;
                const long C = end - nb < DP_COLS ? end - nb : DP_COLS;
                switch (R * 8 + C) {
                    DP_ROW_CASES(1) DP_ROW_CASES(2) DP_ROW_CASES(3) DP_ROW_CASES(4) DP_ROW_CASES(5) DP_ROW_CASES(6)
                }
            }
}
#undef DP_CASE
#undef DP_ROW_CASES
#endif

#ifdef S2S_AMX
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
                       int act, uint16_t *y, float *y32, long y_row)
{
    const long KB = K / 32, NB = (N + 15) / 16;
#define Y(row) (y ? y + (row) * y_row : NULL) /* row's outputs in bf16, or in fp32 */
#define Y32(row) (y32 ? y32 + (row) * y_row : NULL)
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
            finish(sums[0], rows0, N - 16 * nb, b, act, Y(m), Y32(m), y_row, 16 * nb);
            if (rows1 > 0) {
                _tile_stored(1, sums[1], 64);
                finish(sums[1], rows1, N - 16 * nb, b, act, Y(m + 16), Y32(m + 16), y_row, 16 * nb);
            }
            if (two) {
                _tile_stored(2, sums[2], 64);
                finish(sums[2], rows0, N - 16 * (nb + 1), b, act, Y(m), Y32(m), y_row, 16 * (nb + 1));
                if (rows1 > 0) {
                    _tile_stored(3, sums[3], 64);
                    finish(sums[3], rows1, N - 16 * (nb + 1), b, act, Y(m + 16), Y32(m + 16), y_row, 16 * (nb + 1));
                }
            }
        }
    }
    _tile_release();
#undef Y
#undef Y32
}
#endif


/* the product on the kernel s2s_bf16_linear_isa picks: 0, or -1 where there is none */
static int linear(const uint16_t *x, long x_row, long M, long N, long K, const uint16_t *P, const uint16_t *b, int act,
                  uint16_t *y, float *y32, long y_row)
{
    switch (s2s_bf16_linear_isa()) {
#ifdef S2S_AMX
    case ISA_AMX:
        linear_amx(x, x_row, M, N, K, P, b, act, y, y32, y_row);
        return 0;
#endif
#ifdef S2S_AVX512BF16
    case ISA_AVX512BF16:
        linear_dp(x, x_row, M, N, K, P, b, act, y, y32, y_row);
        return 0;
#endif
    default:
        (void)x, (void)x_row, (void)M, (void)N, (void)K, (void)P, (void)b, (void)act, (void)y, (void)y32, (void)y_row;
        return -1;
    }
}

/* y (M, N) = act(x W^T + b), x (M, K) bf16 rows x_row apart, P packed from W (N, K), b NULL or
 * (N) bf16, y rows y_row apart.  Returns 0; -1 where this library or process has neither kernel
 * (s2s_bf16_linear_isa), -2 where K is not a multiple of 32. */
int s2s_bf16_linear(const uint16_t *x, long x_row, long M, long N, long K, const uint16_t *P, const uint16_t *b,
                    int act, uint16_t *y, long y_row)
{
    return K % 32 ? -2 : linear(x, x_row, M, N, K, P, b, act, y, NULL, y_row);
}

/* s2s_bf16_linear with y (M, N) in fp32, the sums not rounded (a search's scores, s2s.native_search) */
int s2s_bf16_linear_f32(const uint16_t *x, long x_row, long M, long N, long K, const uint16_t *P, const uint16_t *b,
                        float *y, long y_row)
{
    return K % 32 ? -2 : linear(x, x_row, M, N, K, P, b, 0, NULL, y, y_row);
}
