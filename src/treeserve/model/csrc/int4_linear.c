/* Group-quantized 4-bit linear layers (GPTQ, AWQ, compressed-tensors W4A16): bfloat16 rows times
 * weights w[n, k] = scale[n, g] * (q[n, k] - zero[n, g]), g = k / group_size, q in 0..15 and the
 * zero point an integer (every format's), built by treeserve/model/cpu_kernels.py.
 *
 * Layout (linear_kernels.int4_pack): q as 16-bit words [n, 32 * ceil(k / 128)]; in each run of 128
 * inputs, word i holds inputs i, i + 32, i + 64 and i + 96 in its four nibbles (a last, short run
 * zeros in the nibbles past k), so that one 64-byte load gives four vectors of 32 weights by a shift
 * and a mask, no shuffles. k is a multiple of 32. A nibble v becomes bfloat16 by its bits
 * alone: 0x4300 | v is 128 + v, exact (the spacing of bfloat16 numbers in [128, 256) is 1). The
 * products are then those of 128 + v, and per row and group
 *     sum_k x[k] (v[k] - zero) = sum_k x[k] (128 + v[k]) - (128 + zero) sum_k x[k],
 * the row's group sums computed once per call. Float32 sums throughout (vdpbf16ps); each group's
 * sums are scaled into the row's accumulator once per group.
 *
 * Needs AVX512-BF16; ts_int4_supported says whether it was built with it. Reads each weight once per
 * INT4_MR rows: for a few rows (a decode step) the bytes read are the bound, a quarter of
 * bfloat16's. */
#include <stdint.h>
#include <stdlib.h>

#include <omp.h>

#include "bf16_tiles.h"
#include "rows16.h"
#include "simd_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define TS_INT4 1
#define INT4_MR 4   /* rows per tile */
#define INT4_NR 2   /* channels per tile: with INT4_MR rows, 16 of the 32 vector registers hold sums */
#endif

int ts_int4_supported(void)
{
#if defined(TS_INT4)
    return 1;
#else
    return 0;
#endif
}

#if defined(TS_INT4)
#define INT4_RUN 128  /* inputs per 64-byte run of the layout */
#define INT4_PREFETCH 1024  /* bytes of each channel's weights fetched ahead */

/* The run's m-th vector of 32 weights (nibble m of each word) as bfloat16 128 + v. */
static inline __m512bh nibbles(__m512i run, int m)
{
    return (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(run, 4 * m), _mm512_set1_epi16(0x000F),
                                               _mm512_set1_epi16(0x4300), 0xEA);  /* (a & b) | c */
}

/* Rows m0 .. m0 + mr against channels n0 .. n0 + nr (a short block repeats its first channel,
 * never stored); `mr` is a constant at each call site. sums[r * groups + g]: row r's group sums. */
static inline __attribute__((always_inline)) void int4_tile(const uint16_t *x, int64_t x_stride,
        const uint16_t *const *w_rows, const float *scales, const float *zeros, const float *sums, uint16_t *out,
        int64_t n_out, int64_t k_in, int64_t group_size, int64_t m0, int64_t n0, int mr, int nr)
{
    const int64_t groups = k_in / group_size;
    __m512 acc[INT4_MR][INT4_NR], part[INT4_MR][INT4_NR];
    float offset[INT4_MR][INT4_NR];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < INT4_NR; j++) {
            acc[r][j] = part[r][j] = _mm512_setzero_ps();
            offset[r][j] = 0.0f;
        }
    int64_t channel[INT4_NR];
    for (int j = 0; j < INT4_NR; j++)
        channel[j] = n0 + (j < nr ? j : 0);
    for (int64_t k0 = 0; k0 < k_in; k0 += INT4_RUN) {
        __m512i run[INT4_NR];
        for (int j = 0; j < INT4_NR; j++) {
            _mm_prefetch((const char *)(w_rows[j] + k0 / 4) + INT4_PREFETCH, _MM_HINT_T0);
            run[j] = _mm512_loadu_si512((const void *)(w_rows[j] + k0 / 4));
        }
        for (int m = 0; m < 4 && k0 + 32 * m < k_in; m++) {
            int64_t k = k0 + 32 * m;
            __m512bh wv[INT4_NR];
            for (int j = 0; j < INT4_NR; j++)
                wv[j] = nibbles(run[j], m);
            for (int r = 0; r < mr; r++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + r) * x_stride + k));
                for (int j = 0; j < INT4_NR; j++)
                    part[r][j] = _mm512_dpbf16_ps(part[r][j], xv, wv[j]);
            }
            if ((k + 32) % group_size)
                continue;
            int64_t g = k / group_size;  /* the group ends here: scale its sums into the rows' */
            for (int j = 0; j < INT4_NR; j++) {
                float scale = scales[channel[j] * groups + g], shift = scale * (128.0f + zeros[channel[j] * groups + g]);
                for (int r = 0; r < mr; r++) {
                    acc[r][j] = _mm512_fmadd_ps(part[r][j], _mm512_set1_ps(scale), acc[r][j]);
                    part[r][j] = _mm512_setzero_ps();
                    offset[r][j] += shift * sums[(m0 + r) * groups + g];
                }
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++)
            out[(m0 + r) * n_out + n0 + j] = float_to_bf16(_mm512_reduce_add_ps(acc[r][j]) - offset[r][j]);
}
#endif

/* out [rows, n_out] bfloat16 (contiguous) = x [rows, k_in] bfloat16 (rows x_stride elements
 * apart) times w^T, w as in the header: q [n_out, 32 * ceil(k_in / 128)] words, scales and zeros float32
 * [n_out, k_in / group_size]. Returns -1 where it cannot run (not built with AVX512-BF16,
 * group_size not a multiple of 32 or not dividing k_in): the caller keeps its PyTorch path. */
int ts_int4_linear(const uint16_t *x, int64_t x_stride, const uint16_t *q, const float *scales, const float *zeros,
                   uint16_t *out, int64_t rows, int64_t n_out, int64_t k_in, int64_t group_size)
{
#if defined(TS_INT4)
    if (group_size <= 0 || group_size % 32 || k_in % group_size)
        return -1;
    const int64_t words = (k_in + INT4_RUN - 1) / INT4_RUN * (INT4_RUN / 4);  /* per channel */
    if (rows == 0)
        return 0;
    int64_t groups = k_in / group_size;
    float *sums = malloc(sizeof(float) * (size_t)(rows * groups));
    if (sums == NULL)
        return -2;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows * groups; i++) {  /* each row's group sums, as vdpbf16ps sees x */
        const uint16_t *src = x + (i / groups) * x_stride + (i % groups) * group_size;
        float total = 0.0f;
        for (int64_t k = 0; k < group_size; k++)
            total += bf16_to_float(src[k]);
        sums[i] = total;
    }
    int64_t blocks = (n_out + INT4_NR - 1) / INT4_NR;
#pragma omp parallel for schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        int64_t n0 = block * INT4_NR;
        int nr = n_out - n0 < INT4_NR ? (int)(n_out - n0) : INT4_NR;
        const uint16_t *w_rows[INT4_NR];
        for (int j = 0; j < INT4_NR; j++)
            w_rows[j] = q + (n0 + (j < nr ? j : 0)) * words;
        int64_t m0 = 0;
        for (; m0 + INT4_MR <= rows; m0 += INT4_MR)
            int4_tile(x, x_stride, w_rows, scales, zeros, sums, out, n_out, k_in, group_size, m0, n0, INT4_MR, nr);
        switch (rows - m0) {
        case 3: int4_tile(x, x_stride, w_rows, scales, zeros, sums, out, n_out, k_in, group_size, m0, n0, 3, nr); break;
        case 2: int4_tile(x, x_stride, w_rows, scales, zeros, sums, out, n_out, k_in, group_size, m0, n0, 2, nr); break;
        case 1: int4_tile(x, x_stride, w_rows, scales, zeros, sums, out, n_out, k_in, group_size, m0, n0, 1, nr); break;
        default: break;
        }
    }
    free(sums);
    return 0;
#else
    (void)x, (void)x_stride, (void)q, (void)scales, (void)zeros, (void)out, (void)rows, (void)n_out, (void)k_in,
        (void)group_size;
    return -1;
#endif
}

/* The dequantized weight, out [n_out, k_in] bfloat16 = scale * (q - zero) rounded once (for a step
 * with many rows: the dense GEMM). */
void ts_int4_dequantize(const uint16_t *q, const float *scales, const float *zeros, uint16_t *out, int64_t n_out,
                        int64_t k_in, int64_t group_size)
{
    const int64_t groups = k_in / group_size, words = (k_in + 127) / 128 * 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
#if defined(TS_INT4)
        if (group_size % 32 == 0) {
            for (int64_t k0 = 0; k0 < k_in; k0 += INT4_RUN) {
                __m512i run = _mm512_loadu_si512((const void *)(q + n * words + k0 / 4));
                for (int m = 0; m < 4 && k0 + 32 * m < k_in; m++) {
                    int64_t k = k0 + 32 * m, g = n * groups + k / group_size;
                    __m512i words = (__m512i)nibbles(run, m);  /* bfloat16 128 + v */
                    __m512 shift = _mm512_set1_ps(128.0f + zeros[g]), scale = _mm512_set1_ps(scales[g]);
                    __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                        _mm512_castsi512_si256(words)), 16));
                    __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                        _mm512_extracti64x4_epi64(words, 1)), 16));
                    lo = _mm512_mul_ps(_mm512_sub_ps(lo, shift), scale);
                    hi = _mm512_mul_ps(_mm512_sub_ps(hi, shift), scale);
                    _mm512_storeu_si512((void *)(out + n * k_in + k), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
            }
            continue;
        }
#endif
        for (int64_t k = 0; k < k_in; k++) {
            uint16_t word = q[n * words + (k / 128) * 32 + k % 32];
            int value = (word >> (4 * ((k % 128) / 32))) & 0x0F;
            int64_t g = n * groups + k / group_size;
            out[n * k_in + k] = float_to_bf16(scales[g] * ((float)value - zeros[g]));
        }
    }
}

/* ---- 16-bit rows against 4-bit channels in blocks (rows16.h) ---------------------------------
 * Layout (linear_kernels.int4_pack16): blocks of 64 channels; for each four inputs k .. k + 3, each
 * channel's two bytes q[k] | q[k + 2] << 4 and q[k + 1] | q[k + 3] << 4 side by side
 * ([blocks][k_in / 4][64][2]), so that a block streams in order (the row-major layout above reads
 * each channel's run apart: near 15 GB/s of its bytes at one row) and 32 bytes widened (vpmovzxbw)
 * hold 16 channels' (q[k], q[k + 1]) in the low nibbles of their 16-bit pairs and (q[k + 2],
 * q[k + 3]) in the high ones: a mask gives one vector for vpdpwssd, a shift the other. Scales and
 * zero points by block at load, float32 [blocks][groups][64], read in order as the spans go by (as
 * [groups][channels], one line 32 KiB from the last at every span's end, they were the bound). The rows are 16-bit integers under
 * a power of two per span (the group, or 256 inputs of a longer one: products under 2^19, a span's
 * lane sums under 2^27), and per span and channel
 *     sum_k x[k] (q[k] - zero) = sum_k x[k] q[k] - zero * sum_k x[k],
 * the rows' span sums made with their 16-bit form. Tiles of INT4_P16_MR rows x 4 vectors. */
#if defined(TS_ROWS16)
#define TS_INT4_ROWS16 1
#define INT4_P16_MR 4
#define INT4_P16_AHEAD 4096  /* bytes of a block's weights asked for ahead (a group of 128's span):
                               1.04-1.46x from 1 to 64 rows on a Zen 5 EPYC; 8 or 16 KiB: no better */

struct int4_p16_call {
    const int16_t *x16;        /* [rows][k_in] */
    const float *span_scales;  /* [rows][spans] */
    const int32_t *span_sums;  /* [rows][spans] */
    const float *scales_t, *zeros_t;  /* [blocks][groups][64] */
    uint16_t *out;
    int64_t rows, n_out, k_in, spans, span, group_size, groups;
};

/* Channel vector j of row m after span s: its sums, less the zero points' share, times the scales
 * into `partial`; after the last span into `out` (bfloat16). */
static inline void int4_p16_finish(const struct int4_p16_call *c, float *partial, int64_t n0, int64_t m, int j,
                                   __m512i acc, int64_t s)
{
    int64_t n = n0 + 16 * j, g = s * c->span / c->group_size, at = m * c->spans + s;
    int64_t group_at = ((n0 / 64) * c->groups + g) * 64 + 16 * j;
    __m512 zero = _mm512_loadu_ps(c->zeros_t + group_at), scale = _mm512_loadu_ps(c->scales_t + group_at);
    __m512 v = _mm512_fnmadd_ps(zero, _mm512_set1_ps((float)c->span_sums[at]), _mm512_cvtepi32_ps(acc));
    v = _mm512_mul_ps(v, _mm512_mul_ps(scale, _mm512_set1_ps(c->span_scales[at])));
    float *p = partial + m * 64 + 16 * j;
    if (s > 0)
        v = _mm512_add_ps(v, _mm512_loadu_ps(p));
    if (s < c->spans - 1) {
        _mm512_storeu_ps(p, v);
        return;
    }
    if (n >= c->n_out)
        return;
    __mmask16 mask = c->n_out - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (c->n_out - n)) - 1u);
    _mm256_mask_storeu_epi16(c->out + m * c->n_out + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

#define I4_INIT(r) __m512i a##r##0 = _mm512_setzero_si512(), a##r##1 = a##r##0, a##r##2 = a##r##0, a##r##3 = a##r##0;
#define I4_STEP(r)                                                                                    \
    {                                                                                                 \
        int32_t first, second;                                                                        \
        memcpy(&first, rows + (r) * c->k_in + k, sizeof first);                                       \
        memcpy(&second, rows + (r) * c->k_in + k + 2, sizeof second);                                 \
        __m512i xa = _mm512_set1_epi32(first), xb = _mm512_set1_epi32(second);                        \
        DPWSSD(a##r##0, xa, lo0); DPWSSD(a##r##0, xb, hi0);                                           \
        DPWSSD(a##r##1, xa, lo1); DPWSSD(a##r##1, xb, hi1);                                           \
        DPWSSD(a##r##2, xa, lo2); DPWSSD(a##r##2, xb, hi2);                                           \
        DPWSSD(a##r##3, xa, lo3); DPWSSD(a##r##3, xb, hi3);                                           \
    }
#define I4_FINISH(r)                                                                                  \
    int4_p16_finish(c, partial, n0, m0 + (r), 0, a##r##0, s);                                         \
    int4_p16_finish(c, partial, n0, m0 + (r), 1, a##r##1, s);                                         \
    int4_p16_finish(c, partial, n0, m0 + (r), 2, a##r##2, s);                                         \
    int4_p16_finish(c, partial, n0, m0 + (r), 3, a##r##3, s);
#define I4_WIDEN(j)                                                                                   \
    __m512i wide##j = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 * (j))));      \
    __m512i lo##j = _mm512_and_si512(wide##j, low), hi##j = _mm512_srli_epi16(wide##j, 4);
#define I4_TILE(name, ROWS)                                                                           \
    static void name(const struct int4_p16_call *c, const uint8_t *block, float *partial, int64_t n0, \
                     int64_t m0, int64_t s)                                                           \
    {                                                                                                 \
        ROWS(I4_INIT)                                                                                 \
        const int16_t *rows = c->x16 + m0 * c->k_in;                                                  \
        const __m512i low = _mm512_set1_epi16(0x000F);                                                \
        int64_t k0 = s * c->span, k1 = k0 + c->span < c->k_in ? k0 + c->span : c->k_in;               \
        for (int64_t k = k0; k < k1; k += 4) {                                                        \
            const uint8_t *w = block + k * 32;                                                        \
            _mm_prefetch((const char *)w + INT4_P16_AHEAD, _MM_HINT_T0);                              \
            _mm_prefetch((const char *)w + INT4_P16_AHEAD + 64, _MM_HINT_T0);                         \
            I4_WIDEN(0) I4_WIDEN(1) I4_WIDEN(2) I4_WIDEN(3)                                           \
            ROWS(I4_STEP)                                                                             \
        }                                                                                             \
        ROWS(I4_FINISH)                                                                               \
    }
#define I4_ROWS1(X) X(0)
#define I4_ROWS2(X) I4_ROWS1(X) X(1)
#define I4_ROWS3(X) I4_ROWS2(X) X(2)
#define I4_ROWS4(X) I4_ROWS3(X) X(3)
I4_TILE(int4_p16_tile1, I4_ROWS1)
I4_TILE(int4_p16_tile2, I4_ROWS2)
I4_TILE(int4_p16_tile3, I4_ROWS3)
I4_TILE(int4_p16_tile4, I4_ROWS4)

static void int4_p16_block(const struct int4_p16_call *c, const uint8_t *block, float *partial, int64_t n0)
{
    for (int64_t s = 0; s < c->spans; s++) {
        int64_t m0 = 0;
        for (; m0 + INT4_P16_MR <= c->rows; m0 += INT4_P16_MR)
            int4_p16_tile4(c, block, partial, n0, m0, s);
        switch (c->rows - m0) {
        case 3: int4_p16_tile3(c, block, partial, n0, m0, s); break;
        case 2: int4_p16_tile2(c, block, partial, n0, m0, s); break;
        case 1: int4_p16_tile1(c, block, partial, n0, m0, s); break;
        default: break;
        }
    }
}
#endif

/* ---- Many rows: each span of a block widened to bfloat16 once, then bf16_tiles.h's tiles -------
 * From INT4_WIDE_ROWS rows on, a block's weights are widened span by span (BF16_SPAN inputs, 128 KiB:
 * they stay in L2) into bf16_linear.c's layout, w = scale x (q - zero) rounded to bfloat16 once (the
 * dequantized weight PyTorch's reference multiplies), and multiplied there by the rows as they are:
 * the widening is paid once per span, not once per 4 rows, and the tiles are the bfloat16 kernel's (6
 * rows x 64 channels, float32 sums over the whole row, no zero-point or scale work per group). The
 * 1B shape's 112 projections on a Zen 5 EPYC (2 cores), against the 16-bit-row tiles above: 0.86x at
 * 16 rows, 0.98x at 32, 1.08x at 48 and 64, 1.16x at 128, 1.19x at 512 (967 GFLOP/s, the bfloat16
 * kernel's rate): a prefill's path, not a decode step's. */
#if defined(TS_INT4_ROWS16) && defined(TS_BF16_TILES)
#define TS_INT4_WIDE 1
#define INT4_WIDE_ROWS 48

/* 16 channels' pairs of bfloat16 128 + q (the bits `nibbles` makes) as bfloat16 scale x (q - zero). */
static inline __m512i widen_pairs(__m512i pairs, __m512 shift, __m512 scale, __m512i interleave)
{
    __m512 first = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    __m512 second = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
    first = _mm512_mul_ps(_mm512_sub_ps(first, shift), scale);
    second = _mm512_mul_ps(_mm512_sub_ps(second, shift), scale);
    /* [16 firsts | 16 seconds] as bfloat16, then each channel's two side by side */
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(second, first));
}

/* Span `span` of block b (its int4_pack16 bytes at `block`) into `stage` [BF16_SPAN / 2][64][2]. */
static void int4_widen_span(const struct int4_p16_call *c, const uint8_t *block, int64_t b, int64_t span,
                            uint16_t *stage)
{
    int64_t k0 = span * BF16_SPAN, k1 = k0 + BF16_SPAN < c->k_in ? k0 + BF16_SPAN : c->k_in, g = -1;
    const __m512i low = _mm512_set1_epi16(0x000F), biased = _mm512_set1_epi16(0x4300);
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 shift[4] = {0}, scale[4] = {0};
    for (int64_t k = k0; k < k1; k += 4) {
        if (k / c->group_size != g) {  /* (groups are whole multiples of 32 inputs: 4 never straddle two) */
            g = k / c->group_size;
            const float *scales = c->scales_t + (b * c->groups + g) * 64, *zeros = c->zeros_t + (b * c->groups + g) * 64;
            for (int j = 0; j < 4; j++) {
                scale[j] = _mm512_loadu_ps(scales + 16 * j);
                shift[j] = _mm512_add_ps(_mm512_loadu_ps(zeros + 16 * j), _mm512_set1_ps(128.0f));
            }
        }
        const uint8_t *w = block + k * 32;
        uint16_t *pair = stage + (k - k0) * 64;  /* pairs (k, k + 1), then (k + 2, k + 3) */
        _mm_prefetch((const char *)w + BF16_SPAN * 32, _MM_HINT_T0);  /* the next span's, while the tiles run */
        _mm_prefetch((const char *)w + BF16_SPAN * 32 + 64, _MM_HINT_T0);
        for (int j = 0; j < 4; j++) {
            __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 * j)));
            __m512i first = _mm512_ternarylogic_epi32(wide, low, biased, 0xEA);  /* (a & b) | c */
            __m512i second = _mm512_ternarylogic_epi32(_mm512_srli_epi16(wide, 4), low, biased, 0xEA);
            _mm512_store_si512((void *)(pair + 32 * j), widen_pairs(first, shift[j], scale[j], interleave));
            _mm512_store_si512((void *)(pair + 128 + 32 * j), widen_pairs(second, shift[j], scale[j], interleave));
        }
    }
}

/* The product at INT4_WIDE_ROWS rows or more: every block, span by span, widened then multiplied. */
static int int4_wide_linear(const struct int4_p16_call *q, const uint16_t *x, int64_t x_stride, const uint8_t *packed)
{
    struct bf16_call c = {.x = x, .x_stride = x_stride, .out = q->out, .rows = q->rows, .n_out = q->n_out,
                          .k_in = q->k_in, .spans = (q->k_in + BF16_SPAN - 1) / BF16_SPAN, .ahead = 0};
    int64_t blocks = (q->n_out + 63) / 64;
    size_t threads = (size_t)omp_get_max_threads(), partial_floats = (size_t)(q->rows * 64);
    float *partials = malloc(partial_floats * sizeof(float) * threads);
    uint16_t *stages = aligned_alloc(64, (size_t)BF16_SPAN * 64 * sizeof(uint16_t) * threads);
    if (partials == NULL || stages == NULL) {
        free(partials);
        free(stages);
        return -2;
    }
#pragma omp parallel
    {
        float *partial = partials + (size_t)omp_get_thread_num() * partial_floats;
        uint16_t *stage = stages + (size_t)omp_get_thread_num() * BF16_SPAN * 64;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t span = 0; span < c.spans; span++) {
                int4_widen_span(q, packed + b * 32 * q->k_in, b, span, stage);
                bf16_span_tiles(&c, stage, partial, b * 64, span);
            }
    }
    free(partials);
    free(stages);
    return 0;
}
#endif

/* The row count from which ts_int4_linear_packed16 widens the weights to bfloat16 (0: it never does here). */
int64_t ts_int4_wide_rows(void)
{
#if defined(TS_INT4_WIDE)
    return INT4_WIDE_ROWS;
#else
    return 0;
#endif
}

/* The span ts_int4_linear_packed16 takes for this group size (0: it cannot run it): the group, or
 * 256 inputs where 256 divides it or it is the whole row. */
int64_t ts_int4_packed16_span(int64_t k_in, int64_t group_size)
{
#if defined(TS_INT4_ROWS16)
    if (k_in % 32 || group_size <= 0 || group_size % 32 || k_in % group_size)
        return 0;
    if (group_size <= 256)
        return group_size;
    return group_size % 256 == 0 || group_size == k_in ? 256 : 0;
#else
    (void)k_in, (void)group_size;
    return 0;
#endif
}

/* out [rows, n_out] bfloat16 (contiguous) = x [rows, k_in] bfloat16 (rows x_stride elements apart)
 * times the int4_pack16ed weight, scales_t and zeros_t float32 [blocks][k_in / group_size][64]
 * (int4_pack16_groups). Returns 0; -1 where it cannot run (ts_int4_packed16_span 0); -2 out of
 * memory. */
int ts_int4_linear_packed16(const uint16_t *x, int64_t x_stride, const uint8_t *packed, const float *scales_t,
                            const float *zeros_t, uint16_t *out, int64_t rows, int64_t n_out, int64_t k_in,
                            int64_t group_size)
{
#if defined(TS_INT4_ROWS16)
    int64_t span = ts_int4_packed16_span(k_in, group_size);
    if (span == 0)
        return -1;
    int64_t spans = (k_in + span - 1) / span, blocks = (n_out + 63) / 64;
#if defined(TS_INT4_WIDE)
    if (rows >= INT4_WIDE_ROWS) {
        struct int4_p16_call wide = {.scales_t = scales_t, .zeros_t = zeros_t, .out = out, .rows = rows,
                                     .n_out = n_out, .k_in = k_in, .group_size = group_size,
                                     .groups = k_in / group_size};
        return int4_wide_linear(&wide, x, x_stride, packed);
    }
#endif
    size_t x_bytes = (size_t)(rows * k_in) * sizeof(int16_t), per_span = (size_t)(rows * spans);
    size_t partial_floats = (size_t)(rows * 64);
    char *scratch = malloc(x_bytes + per_span * (sizeof(float) + sizeof(int32_t))
                           + partial_floats * sizeof(float) * (size_t)omp_get_max_threads());
    if (scratch == NULL)
        return -2;
    float *span_scales = (float *)(scratch + x_bytes);
    int32_t *span_sums = (int32_t *)(span_scales + per_span);
    float *partials = (float *)(span_sums + per_span);
    struct int4_p16_call c = {.x16 = (int16_t *)scratch, .span_scales = span_scales, .span_sums = span_sums,
                              .scales_t = scales_t, .zeros_t = zeros_t, .out = out, .rows = rows, .n_out = n_out,
                              .k_in = k_in, .spans = spans, .span = span, .group_size = group_size,
                              .groups = k_in / group_size};
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++)
            rows_to_int16(x, x_stride, m, k_in, span, (int16_t *)scratch + m * k_in, span_scales + m * spans,
                          span_sums + m * spans);
        float *partial = partials + (size_t)omp_get_thread_num() * partial_floats;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            int4_p16_block(&c, packed + b * 32 * k_in, partial, b * 64);
    }
    free(scratch);
    return 0;
#else
    (void)x, (void)x_stride, (void)packed, (void)scales_t, (void)zeros_t, (void)out, (void)rows, (void)n_out,
        (void)k_in, (void)group_size;
    return -1;
#endif
}
