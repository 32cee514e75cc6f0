/* bfloat16 linear layers over weights packed at load (model/packed_linear.py's `Bf16Linear`); the
 * layout and the tiles are bf16_tiles.h's. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "bf16_tiles.h"

#if defined(TS_BF16_TILES)
#define TS_BF16_LINEAR 1

/* One block of 64 channels: each span through every tile of rows. */
static void bf16_block(const struct bf16_call *c, const uint16_t *block, float *partial, int64_t n0)
{
    for (int64_t span = 0; span < c->spans; span++)
        bf16_span_tiles(c, block + span * BF16_SPAN * 64, partial, n0, span);
}
#endif


/* Whether ts_bf16_linear runs on this CPU (AVX512-BF16). */
int ts_bf16_linear_supported(void)
{
#if defined(TS_BF16_LINEAR)
    return 1;
#else
    return 0;
#endif
}

#if defined(TS_BF16_LINEAR)
/* Every block of channels, split between the threads; -2 out of memory. */
static int bf16_run(struct bf16_call *c)
{
    c->spans = (c->k_in + BF16_SPAN - 1) / BF16_SPAN;
    int64_t blocks = (c->n_out + 63) / 64;
    size_t partial_floats = c->spans > 1 ? (size_t)(c->rows * 64) : 0;
    float *partials = NULL;
    if (partial_floats) {
        partials = malloc(partial_floats * sizeof(float) * (size_t)omp_get_max_threads());
        if (partials == NULL)
            return -2;
    }
#pragma omp parallel
    {
        float *partial = partials == NULL ? NULL : partials + (size_t)omp_get_thread_num() * partial_floats;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            bf16_block(c, c->packed + b * 64 * c->k_in, partial, b * 64);
    }
    free(partials);
    return 0;
}
#endif

/* out [rows, n_out] bfloat16 (contiguous) = x [rows, k_in] bfloat16 (rows x_stride elements apart,
 * 4-byte aligned pairs) times w^T (+ bias [n_out] bfloat16, or NULL), w in the bf16_pack layout
 * (k_in even). Returns 0; -1 where it cannot run (no AVX512-BF16, k_in odd); -2 out of memory. */
int ts_bf16_linear(const void *x, int64_t x_stride, const void *packed, const void *bias, void *out, int64_t rows,
                   int64_t n_out, int64_t k_in)
{
#if defined(TS_BF16_LINEAR)
    if (k_in % 2)
        return -1;
    struct bf16_call c = {.x = (const uint16_t *)x, .x_stride = x_stride, .packed = (const uint16_t *)packed,
                          .bias = (const uint16_t *)bias, .out = (uint16_t *)out, .rows = rows, .n_out = n_out,
                          .k_in = k_in, .ahead = BF16_AHEAD};
    return bf16_run(&c);
#else
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)out; (void)rows; (void)n_out; (void)k_in;
    return -1;
#endif
}

/* out [rows, size] bfloat16 (contiguous) = silu(gate) * up, where gate and up are x's products with
 * a weight [2 x size, k_in] (+ bias [2 x size]) whose channels (and bias) come in blocks of 32 gates
 * then the same 32 channels' ups, bf16_pack'ed (linear_kernels.gate_up_grouped). Returns 0; -1
 * where it cannot run (no AVX512-BF16, k_in odd, size not a multiple of 32); -2 out of memory. */
int ts_bf16_linear_silu_mul(const void *x, int64_t x_stride, const void *packed, const void *bias, void *out,
                            int64_t rows, int64_t size, int64_t k_in)
{
#if defined(TS_BF16_LINEAR)
    if (k_in % 2 || size % 32)
        return -1;
    struct bf16_call c = {.x = (const uint16_t *)x, .x_stride = x_stride, .packed = (const uint16_t *)packed,
                          .bias = (const uint16_t *)bias, .out = (uint16_t *)out, .rows = rows, .n_out = 2 * size,
                          .k_in = k_in, .silu_mul = 1, .ahead = BF16_AHEAD};
    return bf16_run(&c);
#else
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)out; (void)rows; (void)size; (void)k_in;
    return -1;
#endif
}

/* out [rows, n_out] bfloat16 = x times w^T (+ bias), as ts_bf16_linear, with channels below
 * rotary_channels (q's then k's heads of head_dim, a multiple of 64) rotated as the attention's rotary
 * embedding (rotate-half) rotates them at each row's `positions` entry of the float32 tables cos and
 * sin [*, head_dim]; those channels' weights (and bias) in linear_kernels.qkv_grouped's order,
 * bf16_pack'ed. Returns 0; -1 where it cannot run (no AVX512-BF16, k_in odd, a head_dim or
 * rotary_channels it does not take); -2 out of memory. */
int ts_bf16_linear_rotary(const void *x, int64_t x_stride, const void *packed, const void *bias, void *out,
                          int64_t rows, int64_t n_out, int64_t k_in, const int64_t *positions, const float *cos,
                          const float *sin, int64_t head_dim, int64_t rotary_channels)
{
#if defined(TS_BF16_LINEAR)
    if (k_in % 2 || head_dim <= 0 || head_dim % 64 || rotary_channels % head_dim || rotary_channels > n_out)
        return -1;
    struct bf16_call c = {.x = (const uint16_t *)x, .x_stride = x_stride, .packed = (const uint16_t *)packed,
                          .bias = (const uint16_t *)bias, .out = (uint16_t *)out, .rows = rows, .n_out = n_out,
                          .k_in = k_in, .ahead = BF16_AHEAD, .rotary_channels = rotary_channels,
                          .head_dim = head_dim, .positions = positions, .cos = cos, .sin = sin};
    return bf16_run(&c);
#else
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)out; (void)rows; (void)n_out; (void)k_in;
    (void)positions; (void)cos; (void)sin; (void)head_dim; (void)rotary_channels;
    return -1;
#endif
}
