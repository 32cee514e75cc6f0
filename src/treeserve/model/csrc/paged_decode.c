/* Decode attention on bfloat16 paged caches (one query token per sequence), in two passes per
 * segment of keys instead of an online softmax per tile of 16:
 *   1. every key of the segment scored (vdpbf16ps over the stored query and keys, float32 sums,
 *      times the scale) into a buffer;
 *   2. the segment's maximum per query head, exp of the scores minus it, their sum, and the
 *      probabilities rounded to bfloat16 (as PyTorch's bfloat16 kernels and the tile path do);
 *   3. the values weighted by those probabilities (vdpbf16ps over token pairs), the accumulators
 *      of all the group's query heads held in registers across the segment.
 * Segments are merged by their maxima (one rescale per DECODE_SEGMENT keys). The tile path folds
 * each tile of 16 keys into a running softmax, a chain of dependent steps per tile that kept two
 * Zen 4 cores at 22 cycles a score; this path's loops are independent work. */
#include <stdint.h>
#include <string.h>

#include "paged_decode.h"
#include "simd_math.h"

#define TS_BFLOAT16 1
#define DECODE_SEGMENT 512     /* keys scored before their values are read */
#define DECODE_PREFETCH 32     /* tokens ahead whose rows are prefetched into L2 */
#define DECODE_MAX_HEAD_DIM 256

#if defined(__AVX512BF16__)
#include <immintrin.h>

int paged_decode_supported(const struct paged_cache *c, int group, int head_dim, float softcap)
{
    return c->dtype == TS_BFLOAT16 && softcap <= 0.0f && group >= 1 && group <= DECODE_MAX_GROUP
           && head_dim % 32 == 0 && head_dim <= DECODE_MAX_HEAD_DIM;
}

/* Whether decode rows over a bfloat16 cache with this group and head size (scores not capped)
 * take this path: for the tests. */
int ts_paged_decode_rows(int group, int head_dim)
{
    struct paged_cache c = {.dtype = TS_BFLOAT16};
    return paged_decode_supported(&c, group, head_dim, 0.0f);
}

/* Per (row, KV head): the running maximum and sum of each query head, its accumulator in the
 * values' interleaved dimension order (see natural_dim), and one segment's scores and
 * probabilities. */
struct decode_state {
    float max[DECODE_MAX_GROUP], sum[DECODE_MAX_GROUP];
    float acc[DECODE_MAX_GROUP * DECODE_MAX_HEAD_DIM];
    float scores[DECODE_MAX_GROUP * (DECODE_SEGMENT + 16)];
    uint32_t probs[DECODE_MAX_GROUP * (DECODE_SEGMENT / 2 + 8)];   /* bfloat16 pairs */
    const char *rows[DECODE_SEGMENT];                               /* the segment's key rows */
};

/* The segment's key rows (this head's): rows[i] for its token i. */
static void segment_rows(struct decode_state *st, const struct paged_cache *c, struct token_cursor *cur, int n,
                         int64_t head_offset)
{
    for (int i = 0; i < n; i++)
        st->rows[i] = cursor_next(cur, c) + head_offset;
}

/* Pass 1: scores[g * (SEGMENT + 16) + i] = scale * q_g . k_i for the segment's n keys. */
static inline __attribute__((always_inline)) void score_segment(struct decode_state *st, const uint16_t *q, int n,
        int group, int head_dim, float scale)
{
    const int chunks = head_dim / 32;
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int count = n - t0 < 16 ? n - t0 : 16;
        for (int t = 0; t < count && t0 + DECODE_PREFETCH + t < n; t++)
            for (int b = 0; b < head_dim * 2; b += 64)
                __builtin_prefetch(st->rows[t0 + DECODE_PREFETCH + t] + b, 0, 1);
        for (int g = 0; g < group; g++) {
            __m512 dots[16];
            for (int t = 0; t < 16; t++) {
                __m512 d = _mm512_setzero_ps();
                if (t < count)
                    for (int j = 0; j < chunks; j++)
                        d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512((const void *)(q + g * head_dim + 32 * j)),
                                             (__m512bh)_mm512_loadu_si512((const void *)(st->rows[t0 + t] + 64 * j)));
                dots[t] = d;
            }
            _mm512_storeu_ps(st->scores + g * (DECODE_SEGMENT + 16) + t0, _mm512_mul_ps(sum16(dots), scaled));
        }
    }
}

/* Pass 2: each query head's new maximum, the accumulator and sum rescaled to it, the segment's
 * probabilities (bfloat16 pairs, zero past n) and their float32 sum added. */
static inline __attribute__((always_inline)) void softmax_segment(struct decode_state *st, int n, int group,
                                                                   int head_dim)
{
    const int vectors = (n + 15) / 16;
    const __mmask16 tail = (__mmask16)((1u << (n - 16 * (vectors - 1))) - 1u);
    for (int g = 0; g < group; g++) {
        const float *s = st->scores + g * (DECODE_SEGMENT + 16);
        __m512 m = _mm512_set1_ps(-3.0e38f);
        for (int v = 0; v < vectors; v++)
            m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-3.0e38f), v == vectors - 1 ? tail : 0xffff,
                                                      s + 16 * v));
        float seg_max = _mm512_reduce_max_ps(m), old = st->max[g];
        float top = seg_max > old ? seg_max : old;
        float rescale = exp_clamped(old - top);
        if (rescale != 1.0f) {
            float *acc = st->acc + g * head_dim;
            for (int d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(rescale)));
        }
        __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(top);
        uint32_t *p = st->probs + g * (DECODE_SEGMENT / 2 + 8);
        for (int v = 0; v < vectors; v++) {
            __mmask16 live = v == vectors - 1 ? tail : 0xffff;
            __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * v), shift)));
            total = _mm512_add_ps(total, e);
            _mm256_storeu_si256((__m256i *)(p + 8 * v), (__m256i)_mm512_cvtneps_pbh(e));
        }
        st->sum[g] = st->sum[g] * rescale + _mm512_reduce_add_ps(total);
        st->max[g] = top;
    }
}

/* Pass 3 for 32 dimensions (chunk j) and a group of G query heads: acc += p * v over the segment's
 * token pairs, G x 2 accumulators in registers. Dimension order as natural_dim says. */
static inline __attribute__((always_inline)) void weigh_values(struct decode_state *st, int n, const int G, int j,
                                                                int head_dim, int64_t kv_stride)
{
    __m512 lo_acc[DECODE_MAX_GROUP], hi_acc[DECODE_MAX_GROUP];
    for (int g = 0; g < G; g++) {
        lo_acc[g] = _mm512_loadu_ps(st->acc + g * head_dim + 32 * j);
        hi_acc[g] = _mm512_loadu_ps(st->acc + g * head_dim + 32 * j + 16);
    }
    for (int t = 0; t < n; t += 2) {
        if (t + DECODE_PREFETCH < n && j == 0)
            for (int b = 0; b < head_dim * 2; b += 64) {
                __builtin_prefetch(st->rows[t + DECODE_PREFETCH] + kv_stride + b, 0, 1);
                if (t + DECODE_PREFETCH + 1 < n)
                    __builtin_prefetch(st->rows[t + DECODE_PREFETCH + 1] + kv_stride + b, 0, 1);
            }
        __m512i a = _mm512_loadu_si512((const void *)(st->rows[t] + kv_stride + 64 * j));
        __m512i b = t + 1 < n ? _mm512_loadu_si512((const void *)(st->rows[t + 1] + kv_stride + 64 * j))
                              : _mm512_setzero_si512();
        __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < G; g++) {
            __m512bh p = (__m512bh)_mm512_set1_epi32((int)st->probs[g * (DECODE_SEGMENT / 2 + 8) + t / 2]);
            lo_acc[g] = _mm512_dpbf16_ps(lo_acc[g], p, lo);
            hi_acc[g] = _mm512_dpbf16_ps(hi_acc[g], p, hi);
        }
    }
    for (int g = 0; g < G; g++) {
        _mm512_storeu_ps(st->acc + g * head_dim + 32 * j, lo_acc[g]);
        _mm512_storeu_ps(st->acc + g * head_dim + 32 * j + 16, hi_acc[g]);
    }
}

/* weigh_values with the group size a constant (its accumulators named registers). */
static void weigh_values_any(struct decode_state *st, int n, int group, int j, int head_dim, int64_t kv_stride)
{
    switch (group) {
    case 1: weigh_values(st, n, 1, j, head_dim, kv_stride); break;
    case 2: weigh_values(st, n, 2, j, head_dim, kv_stride); break;
    case 3: weigh_values(st, n, 3, j, head_dim, kv_stride); break;
    case 4: weigh_values(st, n, 4, j, head_dim, kv_stride); break;
    case 5: weigh_values(st, n, 5, j, head_dim, kv_stride); break;
    case 6: weigh_values(st, n, 6, j, head_dim, kv_stride); break;
    case 7: weigh_values(st, n, 7, j, head_dim, kv_stride); break;
    default: weigh_values(st, n, 8, j, head_dim, kv_stride); break;
    }
}

/* The dimension the accumulator holds at index i: unpacklo/unpackhi of 16-bit elements work
 * within 128-bit lanes, so of each 32 dimensions the first vector holds 0-3, 8-11, 16-19, 24-27
 * and the second 4-7, 12-15, 20-23, 28-31. */
static inline int natural_dim(int i)
{
    int chunk = i / 32, half = (i / 16) % 2, lane = i % 16;
    return chunk * 32 + (lane / 4) * 8 + half * 4 + lane % 4;
}

/* One KV head: its query group's outputs (bfloat16, dimensions in order) at `out`. */
static void attend_head(struct decode_state *st, const uint16_t *q, const struct paged_cache *c,
                        const int64_t *table, int64_t start, int64_t end, int64_t head_offset, int group,
                        int head_dim, float scale, uint16_t *out)
{
    for (int g = 0; g < group; g++) {
        st->max[g] = -3.0e38f;
        st->sum[g] = 0.0f;
    }
    memset(st->acc, 0, sizeof(float) * group * head_dim);
    struct token_cursor cur = cursor_at(c, table, start);
    for (int64_t pos = start; pos < end; pos += DECODE_SEGMENT) {
        int n = end - pos < DECODE_SEGMENT ? (int)(end - pos) : DECODE_SEGMENT;
        segment_rows(st, c, &cur, n, head_offset);
        score_segment(st, q, n, group, head_dim, scale);
        softmax_segment(st, n, group, head_dim);
        for (int j = 0; j < head_dim / 32; j++)
            weigh_values_any(st, n, group, j, head_dim, c->kv_stride);
    }
    for (int g = 0; g < group; g++) {
        float inv = 1.0f / st->sum[g];
        for (int i = 0; i < head_dim; i++)
            out[g * head_dim + natural_dim(i)] = float_to_bf16(st->acc[g * head_dim + i] * inv);
    }
}

void paged_decode_row(const uint16_t *q, const struct paged_cache *c, const int64_t *table, int64_t start,
                      int64_t end, int first_head, int heads, int group, int head_dim, float scale, uint16_t *out)
{
    struct decode_state st;
    for (int h = first_head; h < first_head + heads; h++) {
        int64_t first_q = (int64_t)h * group * head_dim;
        attend_head(&st, q + first_q, c, table, start, end, h * c->head_stride, group, head_dim, scale, out + first_q);
    }
}

#else

int ts_paged_decode_rows(int group, int head_dim)
{
    (void)group, (void)head_dim;
    return 0;
}

int paged_decode_supported(const struct paged_cache *c, int group, int head_dim, float softcap)
{
    (void)c, (void)group, (void)head_dim, (void)softcap;
    return 0;
}

void paged_decode_row(const uint16_t *q, const struct paged_cache *c, const int64_t *table, int64_t start,
                      int64_t end, int first_head, int heads, int group, int head_dim, float scale, uint16_t *out)
{
    (void)q, (void)c, (void)table, (void)start, (void)end, (void)first_head, (void)heads, (void)group;
    (void)head_dim, (void)scale, (void)out;
}

#endif
