/* A prefill chunk's attention in bfloat16 with the CPU's bf16 dot products (AVX512-BF16), reading
 * every key and value of the sequence from the paged cache: the cached prefix and the chunk's own
 * (written before the call), causal for the chunk's rows.
 *
 * Why: PyTorch's CPU flash attention computes bf16 products with float32 GEMMs where the CPU has
 * no AMX (MKL's bf16 GEMM widens to sgemm), about a third of the speed of the bf16 linears on
 * AVX512-BF16 machines; a 8,000-token prompt spends half its time there.
 *
 * How: the keys and values of each KV head are packed once per call into the layouts vdpbf16ps
 * reads (keys: 16 keys x one pair of dimensions per 512-bit vector; values: 16 dimensions x one
 * pair of keys). A unit of work is one KV head and up to FP_MAX_ROWS query rows (positions x the
 * query heads of its group), which walk the keys in tiles of FP_KEY_TILE with an online softmax
 * in float32: scores = q . k (32 products per instruction, summed in float32), probabilities
 * rounded to bf16 (as PyTorch's kernel rounds them before its second product), out += p . v.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "simd_math.h"

#define FP_KEY_TILE 64   /* keys per step of the online softmax */
#define FP_KEY_VECTORS (FP_KEY_TILE / 16)
#define FP_MAX_ROWS 64   /* query rows of one unit: positions x the query heads of a KV head */
#define FP_MAX_HEAD_DIM 256

struct fp_cache {
    const uint16_t *base;    /* one layer's [num_blocks, 2, block_size, kv_heads, head_dim] */
    int64_t block_stride, kv_stride, token_stride, head_stride, block_size;
    const int64_t *block_ids;
};

static inline const uint16_t *fp_row(const struct fp_cache *c, int64_t token, int head, int value)
{
    return c->base + c->block_ids[token / c->block_size] * c->block_stride + value * c->kv_stride
           + (token % c->block_size) * c->token_stride + head * c->head_stride;
}

/* Whether ts_flash_prefill runs this head size here (built with AVX512-BF16). */
int ts_flash_prefill_supported(int head_dim)
{
#if defined(__AVX512BF16__)
    return head_dim % 16 == 0 && head_dim <= FP_MAX_HEAD_DIM;
#else
    (void)head_dim;
    return 0;
#endif
}

#if defined(__AVX512BF16__)
/* Keys of one KV head, 16 to a tile: word (t, d2, j) holds dimensions 2 d2 and 2 d2 + 1 of key
 * 16 t + j (zero past the last key, up to `padded` keys). */
static void pack_keys(const struct fp_cache *c, int head, int64_t num_keys, int head_dim, int64_t padded,
                      uint32_t *dst)
{
    int pairs = head_dim / 2;
    int64_t tiles = padded / 16;
    for (int64_t t = 0; t < tiles; t++) {
        uint32_t *tile = dst + t * pairs * 16;
        for (int j = 0; j < 16; j++) {
            int64_t key = t * 16 + j;
            const uint32_t *src = key < num_keys ? (const uint32_t *)fp_row(c, key, head, 0) : NULL;
            for (int d2 = 0; d2 < pairs; d2++)
                tile[d2 * 16 + j] = src ? src[d2] : 0;
        }
    }
}

/* Values of one KV head, two keys to a word: word (j2, d) holds dimension d of keys 2 j2 and
 * 2 j2 + 1 (zero past the last key). */
static void pack_values(const struct fp_cache *c, int head, int64_t num_keys, int head_dim, int64_t padded,
                        uint32_t *dst)
{
    for (int64_t j2 = 0; j2 < padded / 2; j2++) {
        int64_t key = 2 * j2;
        const uint16_t *a = key < num_keys ? fp_row(c, key, head, 1) : NULL;
        const uint16_t *b = key + 1 < num_keys ? fp_row(c, key + 1, head, 1) : NULL;
        uint32_t *row = dst + j2 * head_dim;
        for (int d = 0; d < head_dim; d++)
            row[d] = (uint32_t)(a ? a[d] : 0) | (uint32_t)(b ? b[d] : 0) << 16;
    }
}

struct fp_unit {
    const uint16_t *q[FP_MAX_ROWS];   /* each row's query vector */
    uint16_t *out[FP_MAX_ROWS];       /* where its output goes */
    int64_t last_key[FP_MAX_ROWS];    /* the last key it sees (its absolute position) */
    int rows;
};

struct fp_scratch {
    float *acc;                       /* [FP_MAX_ROWS][head_dim] */
    float scores[FP_MAX_ROWS][FP_KEY_TILE];
    uint16_t probs[FP_MAX_ROWS][FP_KEY_TILE];
    __m512 sum[FP_MAX_ROWS];          /* per lane: reduced once at the end */
    float max[FP_MAX_ROWS], rescale[FP_MAX_ROWS];
};

/* scores[r][0..FP_KEY_TILE) = scale x q_r . k for the tile's keys, `mr` rows from r0 (4 at most). */
static inline __attribute__((always_inline)) void tile_scores(const struct fp_unit *u, const uint32_t *keys,
                                                              int pairs, float scale, int r0, int mr,
                                                              struct fp_scratch *s)
{
    __m512 acc[4][FP_KEY_VECTORS];
    const uint32_t *q[4];
    for (int r = 0; r < mr; r++) {
        q[r] = (const uint32_t *)u->q[r0 + r];
        for (int v = 0; v < FP_KEY_VECTORS; v++)
            acc[r][v] = _mm512_setzero_ps();
    }
    for (int d2 = 0; d2 < pairs; d2++) {
        __m512bh k[FP_KEY_VECTORS];
        for (int v = 0; v < FP_KEY_VECTORS; v++)
            k[v] = (__m512bh)_mm512_load_si512((const void *)(keys + (v * pairs + d2) * 16));
        for (int r = 0; r < mr; r++) {
            __m512bh qv = (__m512bh)_mm512_set1_epi32((int)q[r][d2]);
            for (int v = 0; v < FP_KEY_VECTORS; v++)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qv, k[v]);
        }
    }
    __m512 sv = _mm512_set1_ps(scale);
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < FP_KEY_VECTORS; v++)
            _mm512_storeu_ps(s->scores[r0 + r] + 16 * v, _mm512_mul_ps(acc[r][v], sv));
}

/* Online softmax over the tile starting at key k0: masks keys past each row's last, updates its
 * running max and (per lane) sum, and leaves the tile's probabilities in bf16 and the factor for
 * its output. */
static void tile_softmax(const struct fp_unit *u, int64_t k0, struct fp_scratch *s)
{
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 none = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < u->rows; r++) {
        __m512 x[FP_KEY_VECTORS];
        int64_t visible = u->last_key[r] - k0 + 1;  /* keys of this tile the row sees */
        __m512 top = none;
        for (int v = 0; v < FP_KEY_VECTORS; v++) {
            x[v] = _mm512_loadu_ps(s->scores[r] + 16 * v);
            if (visible < FP_KEY_TILE) {
                __m512i limit = _mm512_set1_epi32(visible < 0 ? 0 : (int)visible);
                x[v] = _mm512_mask_mov_ps(none, _mm512_cmplt_epi32_mask(
                    _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * v)), limit), x[v]);
            }
            top = _mm512_max_ps(top, x[v]);
        }
        float tile_max = _mm512_reduce_max_ps(top);
        float new_max = tile_max > s->max[r] ? tile_max : s->max[r];
        float rescale = s->max[r] == new_max ? 1.0f : exp_clamped(s->max[r] - new_max);
        s->rescale[r] = rescale;
        __m512 m = _mm512_set1_ps(new_max), total = _mm512_mul_ps(s->sum[r], _mm512_set1_ps(rescale));
        for (int v = 0; v < FP_KEY_VECTORS; v += 2) {
            /* masked keys: exp(-inf) underflows to 0 (exp16 clamps at e^-87, ~1e-38; zeroed) */
            __m512 pa = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x[v], none, _CMP_NEQ_OQ), exp16(_mm512_sub_ps(x[v], m)));
            __m512 pb = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x[v + 1], none, _CMP_NEQ_OQ),
                                            exp16(_mm512_sub_ps(x[v + 1], m)));
            total = _mm512_add_ps(total, _mm512_add_ps(pa, pb));
            _mm512_storeu_si512((void *)(s->probs[r] + 16 * v), (__m512i)_mm512_cvtne2ps_pbh(pb, pa));
        }
        s->sum[r] = total;
        s->max[r] = new_max;
    }
}

/* acc[r] = acc[r] x rescale[r] + probs[r] . values for `mr` rows from r0 and dimension vectors
 * [dv0, dv0 + nv) (mr x nv <= 16 accumulators). */
static inline __attribute__((always_inline)) void tile_values(const uint32_t *values, int head_dim, int r0, int mr,
                                                              int dv0, int nv, struct fp_scratch *s)
{
    __m512 acc[4][4];
    for (int r = 0; r < mr; r++) {
        __m512 f = _mm512_set1_ps(s->rescale[r0 + r]);
        for (int v = 0; v < nv; v++) {
            acc[r][v] = _mm512_loadu_ps(s->acc + (int64_t)(r0 + r) * head_dim + (dv0 + v) * 16);
            if (s->rescale[r0 + r] != 1.0f)
                acc[r][v] = _mm512_mul_ps(acc[r][v], f);
        }
    }
    for (int j2 = 0; j2 < FP_KEY_TILE / 2; j2++) {
        __m512bh vv[4];
        for (int v = 0; v < nv; v++)
            vv[v] = (__m512bh)_mm512_load_si512((const void *)(values + j2 * head_dim + (dv0 + v) * 16));
        for (int r = 0; r < mr; r++) {
            __m512bh p = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)s->probs[r0 + r])[j2]);
            for (int v = 0; v < nv; v++)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], p, vv[v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++)
            _mm512_storeu_ps(s->acc + (int64_t)(r0 + r) * head_dim + (dv0 + v) * 16, acc[r][v]);
}

/* tile_values for every row, 4 at a time. */
static inline __attribute__((always_inline)) void rows_values(int rows, const uint32_t *values, int head_dim,
                                                              int dv0, int nv, struct fp_scratch *s)
{
    int r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4)
        tile_values(values, head_dim, r0, 4, dv0, nv, s);
    for (; r0 < rows; r0++)
        tile_values(values, head_dim, r0, 1, dv0, nv, s);
}

static void attend_unit(const struct fp_unit *u, const uint32_t *keys, const uint32_t *values, int head_dim,
                        float scale, struct fp_scratch *s)
{
    int pairs = head_dim / 2, vectors = head_dim / 16;
    int64_t last = 0;
    for (int r = 0; r < u->rows; r++) {
        last = u->last_key[r] > last ? u->last_key[r] : last;
        s->max[r] = -INFINITY;
        s->sum[r] = _mm512_setzero_ps();
    }
    memset(s->acc, 0, sizeof(float) * (size_t)u->rows * head_dim);
    for (int64_t k0 = 0; k0 <= last; k0 += FP_KEY_TILE) {
        const uint32_t *tile_keys = keys + (k0 / 16) * pairs * 16;
        int r0 = 0;
        for (; r0 + 4 <= u->rows; r0 += 4)
            tile_scores(u, tile_keys, pairs, scale, r0, 4, s);
        for (; r0 < u->rows; r0++)
            tile_scores(u, tile_keys, pairs, scale, r0, 1, s);
        tile_softmax(u, k0, s);
        const uint32_t *tile_values_ = values + (k0 / 2) * head_dim;
        for (int dv0 = 0; dv0 < vectors; dv0 += 4) {
            switch (vectors - dv0) {  /* a constant width at each call: the accumulators stay in registers */
            case 1: rows_values(u->rows, tile_values_, head_dim, dv0, 1, s); break;
            case 2: rows_values(u->rows, tile_values_, head_dim, dv0, 2, s); break;
            case 3: rows_values(u->rows, tile_values_, head_dim, dv0, 3, s); break;
            default: rows_values(u->rows, tile_values_, head_dim, dv0, 4, s); break;
            }
        }
    }
    for (int r = 0; r < u->rows; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(s->sum[r]));
        for (int v = 0; v < vectors; v++) {
            __m512 o = _mm512_mul_ps(_mm512_loadu_ps(s->acc + (int64_t)r * head_dim + v * 16), inv);
            _mm256_storeu_si256((__m256i *)(u->out[r] + v * 16), (__m256i)_mm512_cvtneps_pbh(o));
        }
    }
}
#endif

/* out [query_len, num_heads, head_dim] (bf16; rows out_stride elements apart) = attention of the
 * chunk's queries q [query_len, num_heads, head_dim] (rows q_stride apart) at positions
 * context_len - query_len ... context_len - 1 over the sequence's first context_len keys and
 * values in the paged cache (strides in elements; block_ids int64, one per block of the
 * sequence), causal. Returns 0; -1 where it cannot run (no AVX512-BF16, head size), -2 without
 * memory. */
int ts_flash_prefill(const uint16_t *q, int64_t q_stride, const uint16_t *cache, int64_t block_stride,
                     int64_t kv_stride, int64_t token_stride, int64_t head_stride, int64_t block_size,
                     const int64_t *block_ids, int64_t context_len, int64_t query_len, int num_heads,
                     int num_kv_heads, int head_dim, float scale, uint16_t *out, int64_t out_stride)
{
#if defined(__AVX512BF16__)
    if (!ts_flash_prefill_supported(head_dim) || num_heads % num_kv_heads || num_heads / num_kv_heads > FP_MAX_ROWS)
        return -1;
    struct fp_cache c = {cache, block_stride, kv_stride, token_stride, head_stride, block_size, block_ids};
    int group = num_heads / num_kv_heads;
    int64_t padded = (context_len + FP_KEY_TILE - 1) / FP_KEY_TILE * FP_KEY_TILE;
    size_t per_head = (size_t)padded * head_dim / 2;  /* 32-bit words of one head's keys (or values) */
    uint32_t *keys = aligned_alloc(64, per_head * 4 * num_kv_heads), *values = aligned_alloc(64, per_head * 4 * num_kv_heads);
    if (!keys || !values) {
        free(keys);
        free(values);
        return -2;
    }
    int positions = FP_MAX_ROWS / group;  /* query positions of one unit */
    int64_t blocks = (query_len + positions - 1) / positions, prefix = context_len - query_len;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int h = 0; h < 2 * num_kv_heads; h++) {
            if (h < num_kv_heads)
                pack_keys(&c, h, context_len, head_dim, padded, keys + h * per_head);
            else
                pack_values(&c, h - num_kv_heads, context_len, head_dim, padded, values + (h - num_kv_heads) * per_head);
        }
        struct fp_scratch *s = aligned_alloc(64, sizeof *s);
        float *acc = aligned_alloc(64, sizeof(float) * FP_MAX_ROWS * head_dim);
        if (!s || !acc) {
#pragma omp atomic write
            failed = 1;
        } else {
            s->acc = acc;
        }
#pragma omp barrier
        /* the longest units (latest positions, most keys) first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < blocks * num_kv_heads; unit++) {
            if (failed)
                continue;
            int h = (int)(unit % num_kv_heads);
            int64_t first = (blocks - 1 - unit / num_kv_heads) * positions;
            struct fp_unit u;
            u.rows = 0;
            for (int64_t i = first; i < first + positions && i < query_len; i++)
                for (int g = 0; g < group; g++) {
                    u.q[u.rows] = q + i * q_stride + (int64_t)(h * group + g) * head_dim;
                    u.out[u.rows] = out + i * out_stride + (int64_t)(h * group + g) * head_dim;
                    u.last_key[u.rows] = prefix + i;
                    u.rows++;
                }
            attend_unit(&u, keys + h * per_head, values + h * per_head, head_dim, scale, s);
        }
        free(s);
        free(acc);
    }
    free(keys);
    free(values);
    return failed ? -2 : 0;
#else
    (void)q; (void)q_stride; (void)cache; (void)block_stride; (void)kv_stride; (void)token_stride; (void)head_stride;
    (void)block_size; (void)block_ids; (void)context_len; (void)query_len; (void)num_heads; (void)num_kv_heads;
    (void)head_dim; (void)scale; (void)out; (void)out_stride;
    return -1;
#endif
}
