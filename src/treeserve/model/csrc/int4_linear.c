/* Group-quantized 4-bit linear layers (GPTQ, AWQ, compressed-tensors W4A16): bfloat16 rows times
 * weights w[n, k] = scale[n, g] * (q[n, k] - zero[n, g]), g = k / group_size, q in 0..15 and the
 * zero point an integer (every format's), built by treeserve/model/cpu_kernels.py.
 *
 * Layout (cpu_kernels.int4_pack): q as 16-bit words [n, 32 * ceil(k / 128)]; in each run of 128
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
