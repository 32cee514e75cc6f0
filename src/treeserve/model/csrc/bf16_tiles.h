/* The tiles of csrc/bf16_linear.c's products, shared with the 4-bit kernel's many-row path
 * (int4_linear.c), which widens each span of its weights into this layout first.
 *
 * Layout (linear_kernels.bf16_pack): blocks of 64 output channels; in a block, for each pair of inputs
 * k, k + 1, the 64 channels' two weights side by side ([blocks][k_in / 2][64][2]): one 64-byte load
 * is 16 channels' next pair as vdpbf16ps takes it, and a block streams from memory in order (the
 * layout of int8_linear.c's packed path, which read 25-34 GB/s where row-major tiles read 21-22).
 * Rows enter as they are: each pair of a row's inputs broadcast to every lane. Tiles of BF16_MR rows
 * x 64 channels (24 accumulators in registers), products summed in float32, the result rounded to
 * bfloat16 once (round to nearest even), as oneDNN's bfloat16 kernels do, in another order.
 *
 * SwiGLU's gate and up projections in one (ts_bf16_linear_silu_mul): the weight's channels ordered
 * so that each block holds 32 gates and the ups of the same 32 channels; its tiles end with
 * silu(gate) * up, rounded as cpu_kernels.c's silu_mul rounds, and write the activation alone (the
 * [rows, 2 x size] product is never stored and read back).
 *
 * The attention's q, k and v projection with rotary embedding (ts_bf16_linear_rotary): q's and k's
 * channels ordered so that each block holds 32 dimensions of a head's first half and the same 32 of
 * its second half (the pairs rotate-half mixes); its tiles end with the rotation. */
#ifndef TS_BF16_TILES_H
#define TS_BF16_TILES_H

#include <stdint.h>
#include <string.h>

#include "simd_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TS_BF16_TILES 1
#define BF16_MR 6       /* rows of a tile */
#define BF16_SPAN 1024  /* inputs of a block swept by every tile of rows before the next (its 128 KiB
                           stay in L2); the float32 sums between spans wait in a partial buffer */
#define BF16_AHEAD (BF16_SPAN * 64 * 2)  /* bytes: every tile of rows asks for the next span's weights
                                           into L2 as it reads this one's (1.05-1.17x from 4 to 64 rows on
                                           a Zen 5 EPYC; in the first tile alone: 0.92-1.00x) */

/* acc += pairs of bfloat16 products (vdpbf16ps), in assembly so that GCC keeps the accumulators in
 * registers (as int8_linear.c's DPWSSD). */
#define DPBF16(acc, x, w) __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))

struct bf16_call {
    const uint16_t *x;
    int64_t x_stride;
    const uint16_t *packed;
    const uint16_t *bias;  /* [n_out] or NULL */
    uint16_t *out;
    int64_t rows, n_out, k_in, spans;
    int silu_mul;   /* the layout and output of ts_bf16_linear_silu_mul */
    int64_t ahead;  /* bytes past the weights read that each step asks into L2 (BF16_AHEAD: the next
                       span's, from memory; 0 for weights already in cache) */
    /* ts_bf16_linear_rotary: channels below rotary_channels (q's and k's heads) leave rotated */
    int64_t rotary_channels, head_dim;
    const int64_t *positions;  /* [rows]: each row's row of the tables */
    const float *cos, *sin;    /* [*, head_dim] */
};

/* Channel vector j (16 channels) of row m: after a span but the last, into `partial`; after the
 * last, plus the bias, rounded into `out`. */
static inline void bf16_finish(const struct bf16_call *c, float *partial, int64_t n0, int64_t m, int j,
                               __m512 acc, int64_t span)
{
    float *p = partial + m * 64 + 16 * j;
    if (span > 0)
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(p));
    if (span < c->spans - 1) {
        _mm512_storeu_ps(p, acc);
        return;
    }
    int64_t n = n0 + 16 * j;
    if (n >= c->n_out)
        return;
    __mmask16 mask = c->n_out - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (c->n_out - n)) - 1u);
    if (c->bias != NULL)
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, c->bias + n)), 16)));
    _mm256_mask_storeu_epi16(c->out + m * c->n_out + n, mask, (__m256i)_mm512_cvtneps_pbh(acc));
}

/* silu(gate) * up on 16 channels, each rounding as cpu_kernels.c's silu_mul_row_bf16: the gate and
 * up rounded to bfloat16 (the product's one rounding), silu(gate) rounded, then their product. */
static inline void silu_mul_store(uint16_t *dst, __m512 gate, __m512 up)
{
    gate = bf16x16_round(gate);
    __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate), _mm512_set1_ps(88.0f)));
    __m512 silu = bf16x16_round(_mm512_div_ps(gate, _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    _mm256_storeu_si256((__m256i *)dst, bf16x16_pack(_mm512_mul_ps(silu, bf16x16_round(up))));
}

/* A tile row's four vectors (channels n0 + [0, 64)) summed over the spans: after a span but the
 * last, into `partial` (0); after the last, plus the bias (1: `v` holds the finished sums). */
static inline __attribute__((always_inline)) int bf16_block_row_sums(const struct bf16_call *c, float *partial,
                                                                     int64_t n0, int64_t m, __m512 v[4],
                                                                     int64_t span)
{
    float *p = partial + m * 64;
    if (span > 0)
        for (int j = 0; j < 4; j++)
            v[j] = _mm512_add_ps(v[j], _mm512_loadu_ps(p + 16 * j));
    if (span < c->spans - 1) {
        for (int j = 0; j < 4; j++)
            _mm512_storeu_ps(p + 16 * j, v[j]);
        return 0;
    }
    if (c->bias != NULL)
        for (int j = 0; j < 4; j++)
            v[j] = _mm512_add_ps(v[j], bf16x16_load(c->bias + n0 + 16 * j, 0xFFFF));
    return 1;
}

/* The silu_mul layout (gates of channels n0 / 2 + [0, 32), then their ups): the activation into
 * `out` [rows, n_out / 2]. */
static inline __attribute__((always_inline)) void bf16_finish_silu(const struct bf16_call *c, float *partial,
                                                                   int64_t n0, int64_t m, __m512 v[4], int64_t span)
{
    if (!bf16_block_row_sums(c, partial, n0, m, v, span))
        return;
    uint16_t *dst = c->out + m * (c->n_out / 2) + n0 / 2;
    silu_mul_store(dst, v[0], v[2]);
    silu_mul_store(dst + 16, v[1], v[3]);
}

/* The rotary layout (a head's dimensions 32 t + [0, 32), then the same of its second half, t =
 * (n0 mod head_dim) / 64): rotated (rotate-half), each rounding as cpu_kernels.c's rotary_head_bf16
 * makes it on the product rounded once, into the head's own places in `out`. */
static inline __attribute__((always_inline)) void bf16_finish_rotary(const struct bf16_call *c, float *partial,
                                                                     int64_t n0, int64_t m, __m512 v[4],
                                                                     int64_t span)
{
    if (!bf16_block_row_sums(c, partial, n0, m, v, span))
        return;
    int64_t half = c->head_dim / 2, first = 32 * ((n0 % c->head_dim) / 64);
    const float *cos = c->cos + c->positions[m] * c->head_dim, *sin = c->sin + c->positions[m] * c->head_dim;
    uint16_t *dst = c->out + m * c->n_out + (n0 / c->head_dim) * c->head_dim;
    for (int j = 0; j < 2; j++) {
        int64_t d = first + 16 * j;
        __m512 a = bf16x16_round(v[j]), b = bf16x16_round(v[j + 2]);
        __m512 ca = bf16x16_round(_mm512_loadu_ps(cos + d)), sa = bf16x16_round(_mm512_loadu_ps(sin + d));
        __m512 cb = bf16x16_round(_mm512_loadu_ps(cos + half + d)), sb = bf16x16_round(_mm512_loadu_ps(sin + half + d));
        __m512 ra = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(a, ca)),
                                  bf16x16_round(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b), sa)));
        __m512 rb = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(b, cb)), bf16x16_round(_mm512_mul_ps(a, sb)));
        bf16x16_store(dst + d, ra, 0xFFFF);
        bf16x16_store(dst + half + d, rb, 0xFFFF);
    }
}

#define BF_INIT(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0, a##r##3 = a##r##0;
#define BF_STEP(r)                                                                                    \
    {                                                                                                 \
        int32_t pair;                                                                                 \
        memcpy(&pair, row0 + (r) * c->x_stride + k, sizeof pair);                                     \
        __m512 xv = _mm512_castsi512_ps(_mm512_set1_epi32(pair));                                     \
        DPBF16(a##r##0, xv, w0);                                                                      \
        DPBF16(a##r##1, xv, w1);                                                                      \
        DPBF16(a##r##2, xv, w2);                                                                      \
        DPBF16(a##r##3, xv, w3);                                                                      \
    }
#define BF_FINISH(r)                                                                                  \
    if (c->silu_mul) {                                                                                \
        __m512 v[4] = {a##r##0, a##r##1, a##r##2, a##r##3};                                           \
        bf16_finish_silu(c, partial, n0, m0 + (r), v, span);                                          \
    } else if (n0 < c->rotary_channels) {                                                             \
        __m512 v[4] = {a##r##0, a##r##1, a##r##2, a##r##3};                                           \
        bf16_finish_rotary(c, partial, n0, m0 + (r), v, span);                                        \
    } else {                                                                                          \
        bf16_finish(c, partial, n0, m0 + (r), 0, a##r##0, span);                                      \
        bf16_finish(c, partial, n0, m0 + (r), 1, a##r##1, span);                                      \
        bf16_finish(c, partial, n0, m0 + (r), 2, a##r##2, span);                                      \
        bf16_finish(c, partial, n0, m0 + (r), 3, a##r##3, span);                                      \
    }
#define BF_TILE(name, ROWS)                                                                           \
    static void name(const struct bf16_call *c, const uint16_t *span_w, float *partial, int64_t n0,   \
                     int64_t m0, int64_t span)                                                        \
    {                                                                                                 \
        ROWS(BF_INIT)                                                                                 \
        const uint16_t *row0 = c->x + m0 * c->x_stride;                                               \
        int64_t k0 = span * BF16_SPAN, k1 = k0 + BF16_SPAN < c->k_in ? k0 + BF16_SPAN : c->k_in;      \
        for (int64_t k = k0; k < k1; k += 2) {                                                        \
            const uint16_t *w = span_w + (k - k0) * 64;                                               \
            _mm_prefetch((const char *)w + c->ahead, _MM_HINT_T1);                                    \
            _mm_prefetch((const char *)w + c->ahead + 64, _MM_HINT_T1);                               \
            _mm_prefetch((const char *)w + c->ahead + 128, _MM_HINT_T1);                              \
            _mm_prefetch((const char *)w + c->ahead + 192, _MM_HINT_T1);                              \
            __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 32);                             \
            __m512 w2 = _mm512_loadu_ps(w + 64), w3 = _mm512_loadu_ps(w + 96);                        \
            ROWS(BF_STEP)                                                                             \
        }                                                                                             \
        ROWS(BF_FINISH)                                                                               \
    }
#define BF_ROWS1(X) X(0)
#define BF_ROWS2(X) BF_ROWS1(X) X(1)
#define BF_ROWS3(X) BF_ROWS2(X) X(2)
#define BF_ROWS4(X) BF_ROWS3(X) X(3)
#define BF_ROWS5(X) BF_ROWS4(X) X(4)
#define BF_ROWS6(X) BF_ROWS5(X) X(5)
BF_TILE(bf16_tile1, BF_ROWS1)
BF_TILE(bf16_tile2, BF_ROWS2)
BF_TILE(bf16_tile3, BF_ROWS3)
BF_TILE(bf16_tile4, BF_ROWS4)
BF_TILE(bf16_tile5, BF_ROWS5)
BF_TILE(bf16_tile6, BF_ROWS6)

/* One span of a block of 64 channels (its weights from `span_w`) through every tile of rows. */
static void bf16_span_tiles(const struct bf16_call *c, const uint16_t *span_w, float *partial, int64_t n0,
                            int64_t span)
{
    int64_t m0 = 0;
    for (; m0 + BF16_MR <= c->rows; m0 += BF16_MR)
        bf16_tile6(c, span_w, partial, n0, m0, span);
    switch (c->rows - m0) {
    case 5: bf16_tile5(c, span_w, partial, n0, m0, span); break;
    case 4: bf16_tile4(c, span_w, partial, n0, m0, span); break;
    case 3: bf16_tile3(c, span_w, partial, n0, m0, span); break;
    case 2: bf16_tile2(c, span_w, partial, n0, m0, span); break;
    case 1: bf16_tile1(c, span_w, partial, n0, m0, span); break;
    default: break;
    }
}
#endif

#endif
