/* W8A8 int8 linear layers (compressed-tensors W8A8, model/quantization/activations.py): each row of
 * the input scaled to int8 by its own absolute maximum, multiplied by int8 weights with one float32
 * scale per output channel, in int32 by AVX512-VNNI's vpdpbusd (64 products per instruction, twice
 * vdpbf16ps's 32), then scaled by the row's and the channel's scales.
 *
 * Rows: q = round_half_even(x / s), s = amax(|x|) / 127.5 (a row of zeros: s = FLT_EPSILON),
 * clamped to [-128, 127], as llm-compressor and activations.quantize_rows_int8 do, to the bit.
 * vpdpbusd multiplies unsigned by signed bytes, so a row is stored as u = q + 128 and each
 * channel's sum corrected by 128 * sum_k w[n, k] (`comp`, made when the weight is packed):
 * exact in int32 for any k_in below 2^31 / (255 * 128) = 65,793.
 *
 * Weight layout (linear_kernels.w8a8_pack): blocks of W8A8_NV * 16 channels; in a block, for each four
 * inputs k .. k + 3, the channels' four bytes side by side ([blocks][k_in / 4][16 * W8A8_NV][4]),
 * so that one 64-byte load is 16 channels' next four weights and a block streams from memory in
 * order. Channels past n_out are zero and never stored. Tiles of W8A8_MR rows x W8A8_NV vectors:
 * each weight vector loaded once per W8A8_MR rows, each row's four bytes broadcast once per
 * W8A8_NV vectors. */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#include <omp.h>

#include "simd_math.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TS_W8A8 1
#endif

#define W8A8_NV 4    /* 16-channel vectors per block */
#define W8A8_MR 6    /* rows per tile: 24 accumulators, 4 weight vectors, a broadcast */
#define W8A8_SPAN 256  /* inputs per span: a block's weights for it are 16 KiB */
#define W8A8_AHEAD (W8A8_SPAN * 16 * W8A8_NV)  /* bytes: one span ahead. From two rows on, every tile
                                                  asks for it (Zen 5 EPYC: 1.05x at 2 rows, 1.13x at 4,
                                                  1.22x at 8, 1.40x at 16, 1.09x at 64; at one row
                                                  0.91-0.95x, so not there) */
#define TS_BFLOAT16 1

int ts_w8a8_supported(void)
{
#if defined(TS_W8A8)
    return 1;
#else
    return 0;
#endif
}

int ts_w8a8_block_channels(void)
{
    return 16 * W8A8_NV;
}

#if defined(TS_W8A8)
/* x[at .. at + 16) (the first `valid`) as float32. */
static inline __m512 load16(const void *x, int64_t at, int dtype, __mmask16 valid)
{
    if (dtype == TS_BFLOAT16) {
        __m256i h = _mm256_maskz_loadu_epi16(valid, (const uint16_t *)x + at);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(valid, (const float *)x + at);
}

/* acc += the products of x's unsigned and w's signed bytes, four to a lane. In assembly: GCC 12
 * copies _mm512_dpbusd_epi32's accumulator through other registers and the stack. */
#define DPBUSD(acc, x, w) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))

struct w8a8_call {
    const uint8_t *u;          /* the rows as q + 128, [rows][k_in] */
    const float *row_scales;
    const int32_t *comp;
    const float *w_scales;
    void *out;
    int64_t rows, n_out, k_in;
    int dtype;
};

static inline __mmask16 first(int64_t count)
{
    return count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
}

/* Row m of x as u = q + 128 into `u` (k_in bytes) under scales[m], found here from the row's
 * absolute maximum unless `given`. */
static void quantize_row(const void *x, int64_t x_stride, int dtype, int64_t m, int64_t k_in, uint8_t *u, float *scales,
                         int given)
{
    int64_t base = m * x_stride;
    if (!given) {
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < k_in; k += 16)
            amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x, base + k, dtype, first(k_in - k))));
        float found = _mm512_reduce_max_ps(amax) / 127.5f;
        scales[m] = found == 0.0f ? FLT_EPSILON : found;
    }
    float scale = scales[m];
    const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i offset = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < k_in; k += 16) {
        __mmask16 valid = first(k_in - k);
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load16(x, base + k, dtype, valid), s),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
        __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(q), offset);
        _mm_mask_storeu_epi8(u + k, valid, _mm512_cvtepi32_epi8(v));
    }
}

/* Channel vector j's sums of row r: carried into `partial` between spans, or scaled into `out`
 * after the last (the W8A8 epilogue: (sum - comp) x channel scale x row scale, as PyTorch's
 * float32 steps round them). */
static inline void w8a8_finish(const struct w8a8_call *c, int32_t *partial, int64_t n0, int64_t m, int j,
                               __m512i acc, int last)
{
    const int width = 16 * W8A8_NV;
    if (!last) {
        _mm512_storeu_si512((void *)(partial + m * width + 16 * j), acc);
        return;
    }
    int64_t n = n0 + 16 * j;
    if (n >= c->n_out)
        return;
    __mmask16 mask = first(c->n_out - n);
    __m512i comp = _mm512_maskz_loadu_epi32(mask, c->comp + n);
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, comp)), _mm512_maskz_loadu_ps(mask, c->w_scales + n));
    v = _mm512_mul_ps(v, _mm512_set1_ps(c->row_scales[m]));
    int64_t at = m * c->n_out + n;
    if (c->dtype == TS_BFLOAT16)
        _mm256_mask_storeu_epi16((uint16_t *)c->out + at, mask, bf16x16_pack(v));  /* (no AVX512-BF16 needed) */
    else
        _mm512_mask_storeu_ps((float *)c->out + at, mask, v);
}

/* The tile of rows m0 + r for each r in ROWS against one block's channels over inputs k0 .. k1,
 * one named accumulator per row and vector (GCC 12 keeps an array of them on the stack). */
#define ACC_INIT(r)                                                                                   \
    __m512i a##r##0, a##r##1, a##r##2, a##r##3;                                                       \
    if (k0 == 0) {                                                                                    \
        a##r##0 = a##r##1 = a##r##2 = a##r##3 = _mm512_setzero_si512();                               \
    } else {                                                                                          \
        const int32_t *p = partial + (m0 + r) * 16 * W8A8_NV;                                         \
        a##r##0 = _mm512_loadu_si512((const void *)p);                                                \
        a##r##1 = _mm512_loadu_si512((const void *)(p + 16));                                         \
        a##r##2 = _mm512_loadu_si512((const void *)(p + 32));                                         \
        a##r##3 = _mm512_loadu_si512((const void *)(p + 48));                                         \
    }
#define ACC_STEP(r)                                                                                   \
    {                                                                                                 \
        int32_t four;                                                                                 \
        memcpy(&four, rows + (r) * c->k_in + k, sizeof four);                                         \
        __m512i xv = _mm512_set1_epi32(four);                                                         \
        DPBUSD(a##r##0, xv, w0);                                                                      \
        DPBUSD(a##r##1, xv, w1);                                                                      \
        DPBUSD(a##r##2, xv, w2);                                                                      \
        DPBUSD(a##r##3, xv, w3);                                                                      \
    }
#define ACC_FINISH(r)                                                                                 \
    w8a8_finish(c, partial, n0, m0 + (r), 0, a##r##0, last);                                          \
    w8a8_finish(c, partial, n0, m0 + (r), 1, a##r##1, last);                                          \
    w8a8_finish(c, partial, n0, m0 + (r), 2, a##r##2, last);                                          \
    w8a8_finish(c, partial, n0, m0 + (r), 3, a##r##3, last);
#define W8A8_TILE(name, ROWS)                                                                         \
    static void name(const struct w8a8_call *c, const int8_t *block, int32_t *partial, int64_t n0,    \
                     int64_t m0, int64_t k0, int64_t k1)                                             \
    {                                                                                                 \
        ROWS(ACC_INIT)                                                                                \
        const uint8_t *rows = c->u + m0 * c->k_in;                                                    \
        for (int64_t k = k0; k < k1; k += 4) {                                                        \
            const int8_t *w = block + k * 16 * W8A8_NV;                                               \
            if (c->rows > 1) { /* the next span's weights into L2 (one row: the hardware's alone) */  \
                _mm_prefetch((const char *)w + W8A8_AHEAD, _MM_HINT_T1);                              \
                _mm_prefetch((const char *)w + W8A8_AHEAD + 64, _MM_HINT_T1);                         \
                _mm_prefetch((const char *)w + W8A8_AHEAD + 128, _MM_HINT_T1);                        \
                _mm_prefetch((const char *)w + W8A8_AHEAD + 192, _MM_HINT_T1);                        \
            }                                                                                         \
            __m512i w0 = _mm512_loadu_si512((const void *)w);                                         \
            __m512i w1 = _mm512_loadu_si512((const void *)(w + 64));                                  \
            __m512i w2 = _mm512_loadu_si512((const void *)(w + 128));                                 \
            __m512i w3 = _mm512_loadu_si512((const void *)(w + 192));                                 \
            ROWS(ACC_STEP)                                                                            \
        }                                                                                             \
        int last = k1 == c->k_in;                                                                     \
        ROWS(ACC_FINISH)                                                                              \
    }
#define ROWS1(X) X(0)
#define ROWS2(X) ROWS1(X) X(1)
#define ROWS3(X) ROWS2(X) X(2)
#define ROWS4(X) ROWS3(X) X(3)
#define ROWS5(X) ROWS4(X) X(4)
#define ROWS6(X) ROWS5(X) X(5)
W8A8_TILE(w8a8_tile1, ROWS1)
W8A8_TILE(w8a8_tile2, ROWS2)
W8A8_TILE(w8a8_tile3, ROWS3)
W8A8_TILE(w8a8_tile4, ROWS4)
W8A8_TILE(w8a8_tile5, ROWS5)
W8A8_TILE(w8a8_tile6, ROWS6)

/* One block of channels: spans of W8A8_SPAN inputs (its weights for a span stay in L1 while every
 * tile of rows reads them), each span through every tile of rows. */
static void w8a8_block(const struct w8a8_call *c, const int8_t *block, int32_t *partial, int64_t n0)
{
    for (int64_t k0 = 0; k0 < c->k_in; k0 += W8A8_SPAN) {
        int64_t k1 = k0 + W8A8_SPAN < c->k_in ? k0 + W8A8_SPAN : c->k_in;
        int64_t m0 = 0;
        for (; m0 + W8A8_MR <= c->rows; m0 += W8A8_MR)
            w8a8_tile6(c, block, partial, n0, m0, k0, k1);
        switch (c->rows - m0) {
        case 5: w8a8_tile5(c, block, partial, n0, m0, k0, k1); break;
        case 4: w8a8_tile4(c, block, partial, n0, m0, k0, k1); break;
        case 3: w8a8_tile3(c, block, partial, n0, m0, k0, k1); break;
        case 2: w8a8_tile2(c, block, partial, n0, m0, k0, k1); break;
        case 1: w8a8_tile1(c, block, partial, n0, m0, k0, k1); break;
        default: break;
        }
    }
}
#endif

/* out [rows, n_out] (contiguous; float32 or bfloat16: `dtype`, x's too) = the W8A8 product of
 * x [rows, k_in] (rows x_stride elements apart) and the packed weight. k_in a multiple of 4.
 * `row_scales` (float32 [rows]) or NULL: each row's scale, where it is not this row's own (a
 * tensor-parallel rank holding part of each row quantizes by the whole row's maximum).
 * Returns 0; -1 where it cannot run (no AVX512-VNNI, k_in not a multiple of 4); -2 out of memory. */
int ts_w8a8_linear(const void *x, int64_t x_stride, const int8_t *packed, const int32_t *comp, const float *w_scales,
                   const float *given_scales, void *out, int64_t rows, int64_t n_out, int64_t k_in, int dtype)
{
#if defined(TS_W8A8)
    if (k_in % 4)
        return -1;
    int64_t width = 16 * W8A8_NV, blocks = (n_out + width - 1) / width;
    int threads = omp_get_max_threads();
    size_t partial_bytes = (size_t)(rows * width) * sizeof(int32_t);
    char *scratch = malloc((size_t)(rows * k_in) + (size_t)rows * sizeof(float) + partial_bytes * (size_t)threads + 64);
    if (scratch == NULL)
        return -2;
    struct w8a8_call c = {.u = (uint8_t *)scratch, .comp = comp, .w_scales = w_scales, .out = out, .rows = rows,
                          .n_out = n_out, .k_in = k_in, .dtype = dtype};
    float *row_scales = (float *)(scratch + rows * k_in);  /* k_in % 4 == 0: aligned */
    if (given_scales != NULL)
        memcpy(row_scales, given_scales, (size_t)rows * sizeof(float));
    c.row_scales = row_scales;
    int32_t *partials = (int32_t *)(row_scales + rows);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++)
            quantize_row(x, x_stride, dtype, m, k_in, (uint8_t *)scratch + m * k_in, row_scales, given_scales != NULL);
        int32_t *partial = partials + (size_t)omp_get_thread_num() * (size_t)(rows * width);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            w8a8_block(&c, packed + b * width * k_in, partial, b * width);
    }
    free(scratch);
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)comp; (void)w_scales; (void)given_scales; (void)out; (void)rows; (void)n_out; (void)k_in;
    (void)dtype;
    return -1;
#endif
}
