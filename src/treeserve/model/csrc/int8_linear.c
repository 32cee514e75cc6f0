/* Weight-only int8 linear layers (model/quantization/int8.py): w int8 [n_out, k_in] row-major, one
 * float32 scale per output channel. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "rows16.h"
#include "simd_math.h"

#define TS_BFLOAT16 1

#if defined(__AVX512F__)
#include <immintrin.h>
#define INT8_MR 4   /* rows of x per tile */
#define INT8_NR 4   /* output channels per tile: each weight vector is widened once for INT8_MR rows,
                       each activation vector loaded once for INT8_NR channels (16 accumulators) */
#define INT8_PREFETCH 1024  /* bytes of each weight row fetched ahead (one line per 64 weights) */

static inline __m512 widen16(const int8_t *src)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
}

/* One tile: rows m0 .. m0 + mr of x against channels n0 .. n0 + nr; `mr` is a constant at each
 * call site, so each tile height compiles to its own loop. */
static inline __attribute__((always_inline)) void int8_tile(const float *x, int64_t x_stride,
                                                            int dtype, const int8_t *const *w_rows,
                                                            const float *scales, void *out, int64_t n_out,
                                                            int64_t k_in, int64_t m0, int64_t n0, int mr, int nr)
{
    __m512 acc[INT8_MR][INT8_NR];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < INT8_NR; j++)
            acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_in; k += 16) {
        __m512 wv[INT8_NR];
        if (k % 64 == 0)
            for (int j = 0; j < INT8_NR; j++)
                _mm_prefetch((const char *)(w_rows[j] + k + INT8_PREFETCH), _MM_HINT_T0);
        for (int j = 0; j < INT8_NR; j++)
            wv[j] = widen16(w_rows[j] + k);
        for (int r = 0; r < mr; r++) {
            __m512 xv = _mm512_loadu_ps(x + (m0 + r) * x_stride + k);
            for (int j = 0; j < INT8_NR; j++)
                acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) {
            float value = _mm512_reduce_add_ps(acc[r][j]) * scales[n0 + j];
            int64_t at = (m0 + r) * n_out + n0 + j;
            if (dtype == TS_BFLOAT16)
                ((uint16_t *)out)[at] = float_to_bf16(value);
            else
                ((float *)out)[at] = value;
        }
}

#if defined(__AVX512BF16__)
/* The same tile with bfloat16 rows: 32 weights widened to float32 and narrowed to bfloat16 (exact:
 * |q| <= 127 needs 7 bits), then vdpbf16ps: 32 products per instruction, summed in float32. */
static inline __attribute__((always_inline)) void int8_tile_bf16(const uint16_t *x, int64_t x_stride,
                                                                 const int8_t *const *w_rows, const float *scales,
                                                                 uint16_t *out, int64_t n_out, int64_t k_in,
                                                                 int64_t m0, int64_t n0, int mr, int nr)
{
    __m512 acc[INT8_MR][INT8_NR];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < INT8_NR; j++)
            acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_in; k += 32) {
        __m512bh wv[INT8_NR];
        if (k % 64 == 0)
            for (int j = 0; j < INT8_NR; j++)
                _mm_prefetch((const char *)(w_rows[j] + k + INT8_PREFETCH), _MM_HINT_T0);
        for (int j = 0; j < INT8_NR; j++)
            wv[j] = _mm512_cvtne2ps_pbh(widen16(w_rows[j] + k + 16), widen16(w_rows[j] + k));
        for (int r = 0; r < mr; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + r) * x_stride + k));
            for (int j = 0; j < INT8_NR; j++)
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++)
            out[(m0 + r) * n_out + n0 + j] = float_to_bf16(_mm512_reduce_add_ps(acc[r][j]) * scales[n0 + j]);
}
#endif

#endif

#if defined(TS_ROWS16)
#define TS_INT8_ROWS16 1
#define INT8_SPAN 256  /* inputs sharing one power-of-two scale per row: 128 pairs of products of at
                          most 2^15 x 2^7 each stay under 2^31 in a lane's int32 sum */
#endif

#if defined(TS_INT8_ROWS16)
/* ---- the packed layout: 16-bit rows against int8 channels in blocks ----------------------------
 * Weights packed at load (linear_kernels.int8_pack16) in blocks of 64 channels; in a block, for each
 * pair of inputs k, k + 1, the channels' two bytes side by side ([blocks][k_in / 2][64][2]), so
 * that a block streams from memory in order (row-major weights, four rows read at once, stayed
 * near 21 GB/s at one row on a 2-core EPYC; w8a8_linear.c's blocks read 25-34) and 32 bytes,
 * widened (vpmovsxbw), are 16 channels' next two weights as vpdpwssd takes them. Tiles of
 * PACKED16_MR rows x 4 vectors; the int32 sums of a span (INT8_SPAN inputs) are scaled into a
 * float32 partial at its end. */
#define PACKED16_MR 6
/* bytes of a block's weights asked for ahead into L2 while a tile reads: the next span (16 KiB), so
 * that the first tile of a span finds it there. The 1B shape's 112 projections on a Zen 5 EPYC
 * (same process, alternating, medians of 5): 1.05x at 1 row, 1.10x at 4, 1.45x at 16, 1.15x at 64;
 * 8 or 32 KiB ahead no better, into L1 (T0) the same. */
#define PACKED16_AHEAD (INT8_SPAN * 64)

struct packed16_call {
    const int16_t *x16;        /* the rows as 16-bit integers, [rows][k_in] */
    const float *span_scales;  /* [rows][spans] */
    const float *scales;
    uint16_t *out;
    int64_t rows, n_out, k_in, spans;
};

/* Channel vector j of row m after a span: its sums scaled into `partial`, and after the last span
 * times the channels' scales into `out` (bfloat16). */
static inline void packed16_finish(const struct packed16_call *c, float *partial, int64_t n0, int64_t m, int j,
                                   __m512i acc, int64_t span)
{
    float *p = partial + m * 64 + 16 * j;
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(c->span_scales[m * c->spans + span]));
    if (span > 0)
        v = _mm512_add_ps(v, _mm512_loadu_ps(p));
    if (span < c->spans - 1) {
        _mm512_storeu_ps(p, v);
        return;
    }
    int64_t n = n0 + 16 * j;
    if (n >= c->n_out)
        return;
    __mmask16 mask = c->n_out - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (c->n_out - n)) - 1u);
    v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, c->scales + n));
    _mm256_mask_storeu_epi16(c->out + m * c->n_out + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

#define P16_INIT(r) __m512i a##r##0 = _mm512_setzero_si512(), a##r##1 = a##r##0, a##r##2 = a##r##0, a##r##3 = a##r##0;
#define P16_STEP(r)                                                                                   \
    {                                                                                                 \
        int32_t pair;                                                                                 \
        memcpy(&pair, rows + (r) * c->k_in + k, sizeof pair);                                         \
        __m512i xv = _mm512_set1_epi32(pair);                                                         \
        DPWSSD(a##r##0, xv, w0);                                                                      \
        DPWSSD(a##r##1, xv, w1);                                                                      \
        DPWSSD(a##r##2, xv, w2);                                                                      \
        DPWSSD(a##r##3, xv, w3);                                                                      \
    }
#define P16_FINISH(r)                                                                                 \
    packed16_finish(c, partial, n0, m0 + (r), 0, a##r##0, span);                                      \
    packed16_finish(c, partial, n0, m0 + (r), 1, a##r##1, span);                                      \
    packed16_finish(c, partial, n0, m0 + (r), 2, a##r##2, span);                                      \
    packed16_finish(c, partial, n0, m0 + (r), 3, a##r##3, span);
#define P16_TILE(name, ROWS)                                                                          \
    static void name(const struct packed16_call *c, const int8_t *block, float *partial, int64_t n0,  \
                     int64_t m0, int64_t span)                                                        \
    {                                                                                                 \
        ROWS(P16_INIT)                                                                                \
        const int16_t *rows = c->x16 + m0 * c->k_in;                                                  \
        int64_t k0 = span * INT8_SPAN, k1 = k0 + INT8_SPAN < c->k_in ? k0 + INT8_SPAN : c->k_in;      \
        for (int64_t k = k0; k < k1; k += 2) {                                                        \
            const int8_t *w = block + k * 64;                                                         \
            _mm_prefetch((const char *)w + PACKED16_AHEAD, _MM_HINT_T1);                              \
            _mm_prefetch((const char *)w + PACKED16_AHEAD + 64, _MM_HINT_T1);                         \
            __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w));                \
            __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32)));         \
            __m512i w2 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + 64)));         \
            __m512i w3 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + 96)));         \
            ROWS(P16_STEP)                                                                            \
        }                                                                                             \
        ROWS(P16_FINISH)                                                                              \
    }
#define P16_ROWS1(X) X(0)
#define P16_ROWS2(X) P16_ROWS1(X) X(1)
#define P16_ROWS3(X) P16_ROWS2(X) X(2)
#define P16_ROWS4(X) P16_ROWS3(X) X(3)
#define P16_ROWS5(X) P16_ROWS4(X) X(4)
#define P16_ROWS6(X) P16_ROWS5(X) X(5)
P16_TILE(packed16_tile1, P16_ROWS1)
P16_TILE(packed16_tile2, P16_ROWS2)
P16_TILE(packed16_tile3, P16_ROWS3)
P16_TILE(packed16_tile4, P16_ROWS4)
P16_TILE(packed16_tile5, P16_ROWS5)
P16_TILE(packed16_tile6, P16_ROWS6)

/* One block of 64 channels: each span through every tile of rows (the span's 16 KiB of weights
 * stay in L1 meanwhile). */
static void packed16_block(const struct packed16_call *c, const int8_t *block, float *partial, int64_t n0)
{
    for (int64_t span = 0; span < c->spans; span++) {
        int64_t m0 = 0;
        for (; m0 + PACKED16_MR <= c->rows; m0 += PACKED16_MR)
            packed16_tile6(c, block, partial, n0, m0, span);
        switch (c->rows - m0) {
        case 5: packed16_tile5(c, block, partial, n0, m0, span); break;
        case 4: packed16_tile4(c, block, partial, n0, m0, span); break;
        case 3: packed16_tile3(c, block, partial, n0, m0, span); break;
        case 2: packed16_tile2(c, block, partial, n0, m0, span); break;
        case 1: packed16_tile1(c, block, partial, n0, m0, span); break;
        default: break;
        }
    }
}
#endif

/* out [rows, n_out] bfloat16 (contiguous) = x [rows, k_in] bfloat16 (rows x_stride elements apart)
 * times (scale x w)^T, w in the int8_pack16 layout (k_in a multiple of 32). Returns 0; -1 where it
 * cannot run (not ts_int8_rows16(), k_in not a multiple of 32); -2 out of memory. */
int ts_int8_linear_packed16(const void *x, int64_t x_stride, const int8_t *packed, const float *scales, void *out,
                            int64_t rows, int64_t n_out, int64_t k_in)
{
#if defined(TS_INT8_ROWS16)
    if (k_in % 32)
        return -1;
    int64_t spans = (k_in + INT8_SPAN - 1) / INT8_SPAN, blocks = (n_out + 63) / 64;
    int threads = omp_get_max_threads();
    size_t x_bytes = (size_t)(rows * k_in) * sizeof(int16_t), scale_bytes = (size_t)(rows * spans) * sizeof(float);
    size_t partial_floats = (size_t)(rows * 64);
    char *scratch = malloc(x_bytes + scale_bytes + partial_floats * sizeof(float) * (size_t)threads);
    if (scratch == NULL)
        return -2;
    struct packed16_call c = {.x16 = (int16_t *)scratch, .span_scales = (float *)(scratch + x_bytes),
                              .scales = scales, .out = (uint16_t *)out, .rows = rows, .n_out = n_out,
                              .k_in = k_in, .spans = spans};
    float *partials = (float *)(scratch + x_bytes + scale_bytes);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++)
            rows_to_int16((const uint16_t *)x, x_stride, m, k_in, INT8_SPAN, (int16_t *)scratch + m * k_in,
                          (float *)(scratch + x_bytes) + m * spans, NULL);
        float *partial = partials + (size_t)omp_get_thread_num() * partial_floats;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            packed16_block(&c, packed + b * 64 * k_in, partial, b * 64);
    }
    free(scratch);
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)scales; (void)out; (void)rows; (void)n_out; (void)k_in;
    return -1;
#endif
}

/* Whether bfloat16 rows enter ts_int8_linear as 16-bit integers (AVX512-BF16, VNNI and BW). */
int ts_int8_rows16(void)
{
#if defined(TS_INT8_ROWS16)
    return 1;
#else
    return 0;
#endif
}

/* Whether ts_int8_linear takes bfloat16 rows as they are (AVX512-BF16, k_in a multiple of 32). */
int ts_int8_bf16_rows(int64_t k_in)
{
#if defined(__AVX512BF16__)
    return k_in % 32 == 0;
#else
    (void)k_in;
    return 0;
#endif
}

/* out [rows, n_out] (contiguous, float32 or bfloat16: `dtype`) = x [rows, k_in] (rows x_stride
 * elements apart: float32, or bfloat16 where `x_bf16`, which ts_int8_bf16_rows allows) times
 * (scale x w)^T, summed in float32. Reads every weight once per INT8_MR rows (the tiles of one
 * channel block run back to back, its weights in L1). Returns -1 where it cannot run (no AVX512,
 * k_in not a multiple of 16): the caller keeps PyTorch's kernel. */
int ts_int8_linear(const void *x, int64_t x_stride, int x_bf16, const int8_t *w, const float *scales, void *out,
                   int64_t rows, int64_t n_out, int64_t k_in, int dtype)
{
#if defined(__AVX512F__)
    if (k_in % 16 || (x_bf16 && (!ts_int8_bf16_rows(k_in) || dtype != TS_BFLOAT16)))
        return -1;
    int64_t blocks = (n_out + INT8_NR - 1) / INT8_NR;
#pragma omp parallel for schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        int64_t n0 = block * INT8_NR;
        int nr = n_out - n0 < INT8_NR ? (int)(n_out - n0) : INT8_NR;
        const int8_t *w_rows[INT8_NR];
        for (int j = 0; j < INT8_NR; j++)  /* a short last block repeats its first channel, never stored */
            w_rows[j] = w + (n0 + (j < nr ? j : 0)) * k_in;
        int64_t m0 = 0;
#if defined(__AVX512BF16__)
        if (x_bf16) {
            const uint16_t *xb = (const uint16_t *)x;
            uint16_t *ob = (uint16_t *)out;
            for (; m0 + INT8_MR <= rows; m0 += INT8_MR)
                int8_tile_bf16(xb, x_stride, w_rows, scales, ob, n_out, k_in, m0, n0, INT8_MR, nr);
            switch (rows - m0) {
            case 3: int8_tile_bf16(xb, x_stride, w_rows, scales, ob, n_out, k_in, m0, n0, 3, nr); break;
            case 2: int8_tile_bf16(xb, x_stride, w_rows, scales, ob, n_out, k_in, m0, n0, 2, nr); break;
            case 1: int8_tile_bf16(xb, x_stride, w_rows, scales, ob, n_out, k_in, m0, n0, 1, nr); break;
            default: break;
            }
            continue;
        }
#endif
        const float *xf = (const float *)x;
        for (; m0 + INT8_MR <= rows; m0 += INT8_MR)
            int8_tile(xf, x_stride, dtype, w_rows, scales, out, n_out, k_in, m0, n0, INT8_MR, nr);
        switch (rows - m0) {
        case 3: int8_tile(xf, x_stride, dtype, w_rows, scales, out, n_out, k_in, m0, n0, 3, nr); break;
        case 2: int8_tile(xf, x_stride, dtype, w_rows, scales, out, n_out, k_in, m0, n0, 2, nr); break;
        case 1: int8_tile(xf, x_stride, dtype, w_rows, scales, out, n_out, k_in, m0, n0, 1, nr); break;
        default: break;
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)x_bf16; (void)w; (void)scales; (void)out; (void)rows; (void)n_out; (void)k_in; (void)dtype;
    return -1;
#endif
}

/* out [n_out, k_in] (contiguous, float32 or bfloat16) = scale[n] x w[n, k]: the weight for a dense
 * GEMM (a step with many rows). */
void ts_int8_dequantize(const int8_t *w, const float *scales, void *out, int64_t n_out, int64_t k_in, int dtype)
{
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const int8_t *row = w + n * k_in;
        float scale = scales[n];
        if (dtype == TS_BFLOAT16) {
            uint16_t *dst = (uint16_t *)out + n * k_in;
            for (int64_t k = 0; k < k_in; k++)
                dst[k] = float_to_bf16((float)row[k] * scale);
        } else {
            float *dst = (float *)out + n * k_in;
            for (int64_t k = 0; k < k_in; k++)
                dst[k] = (float)row[k] * scale;
        }
    }
}
