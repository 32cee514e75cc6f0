/* treeserve's CPU kernels, built by treeserve/model/cpu_kernels.py with the system C compiler
 * (-O3 -march=native -fopenmp) on first use and called through ctypes.
 *
 * OpenMP: the library links libgomp.so.1, which resolves to the copy PyTorch has already loaded,
 * so these loops share PyTorch's thread pool and thread count.
 *
 * Element types: 0 = float32, 1 = bfloat16 (stored as uint16). Every kernel computes in float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "paged_cache.h"
#include "paged_decode.h"
#include "simd_math.h"

#define TS_FLOAT32 0
#define TS_BFLOAT16 1

#define MAX_GROUP 16      /* query heads sharing one KV head */
#define MAX_HEAD_DIM 256
#define TILE 16           /* keys scored at once */
/* Prefill rows of one sequence attended together, each tile of keys and values read once for all
 * of them. */
#define QUERY_BLOCK 16
/* Keys and values are prefetched this many tokens past the next tile, into L2 (prefetcht1):
 * 96 rows of 150-480 tokens, 1.4x faster than without (into L1, no faster). */
#define PREFETCH_DISTANCE 16

/* n elements of type `dtype` at `src` -> float32 at `dst`, times `scale`. */
static inline void load_row(const void *src, int dtype, float *dst, int n, float scale)
{
    if (dtype == TS_BFLOAT16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; i++)
            dst[i] = bf16_to_float(s[i]) * scale;
    } else {
        const float *s = (const float *)src;
        for (int i = 0; i < n; i++)
            dst[i] = s[i] * scale;
    }
}

static inline void store_row(void *dst, int dtype, const float *src, int n, float scale)
{
    if (dtype == TS_BFLOAT16) {
        uint16_t *d = (uint16_t *)dst;
        for (int i = 0; i < n; i++)
            d[i] = float_to_bf16(src[i] * scale);
    } else {
        float *d = (float *)dst;
        for (int i = 0; i < n; i++)
            d[i] = src[i] * scale;
    }
}

/* silu's exponentials go through a small buffer first: one loop fusing exp and the division ran
 * 2x slower (measured, gcc 12, Zen 4). */
#define SILU_TILE 256

/* Online-softmax state of one KV head's query group. */
struct group_state {
    float *q;    /* group * head_dim: the group's query rows (scaled) */
    float *acc;  /* group * head_dim: their outputs so far */
    uint16_t *qb;  /* group * head_dim: the rows as stored (bfloat16 caches), unscaled */
    float scale;   /* what q was scaled by (the bfloat16 path scales the scores instead) */
    float max[MAX_GROUP];
    float sum[MAX_GROUP];
};

/* `count` states with their rows in one allocation (free the states alone); NULL when out of memory. */
static struct group_state *new_states(int count, int group, int head_dim)
{
    size_t floats = (size_t)count * 2 * group * head_dim, halves = (size_t)count * group * head_dim;
    struct group_state *states = malloc(sizeof(struct group_state) * count + sizeof(float) * floats
                                        + sizeof(uint16_t) * halves);
    if (states == NULL)
        return NULL;
    float *rows = (float *)(states + count);
    uint16_t *raw = (uint16_t *)(rows + floats);
    for (int i = 0; i < count; i++) {
        states[i].q = rows + (size_t)i * 2 * group * head_dim;
        states[i].acc = states[i].q + group * head_dim;
        states[i].qb = raw + (size_t)i * group * head_dim;
    }
    return states;
}

/* A tile of keys and values (at most TILE tokens of one KV head) in float32, loaded once for every
 * query row that attends to it. */
struct tile_scalar {
    float k[TILE * MAX_HEAD_DIM], v[TILE * MAX_HEAD_DIM];
};

/* Token t's key row at rows[t] + head_offset, its value row kv_stride further. */
static inline __attribute__((always_inline)) void load_tile_scalar(struct tile_scalar *tile,
        const char *const *rows, int64_t head_offset, const struct paged_cache *c, int count, int head_dim)
{
    for (int t = 0; t < count; t++) {
        load_row(rows[t] + head_offset, c->dtype, tile->k + t * head_dim, head_dim, 1.0f);
        load_row(rows[t] + head_offset + c->kv_stride, c->dtype, tile->v + t * head_dim, head_dim, 1.0f);
    }
}

/* Fold the tile's first `count` keys/values into the group's state; with softcap > 0 each score s
 * becomes softcap * tanh(s / softcap) first (Gemma 2's soft-capped attention). */
static inline __attribute__((always_inline)) void attend_tile_scalar(struct group_state *st,
        const struct tile_scalar *tile, int count, int group, int head_dim, float softcap)
{
    const float *k = tile->k, *v = tile->v;
    float scores[MAX_GROUP * TILE];
    for (int t = 0; t < count; t++) {
        const float *kt = k + t * head_dim;
        for (int g = 0; g < group; g++) {
            const float *q = st->q + g * head_dim;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < head_dim; d++)
                s += q[d] * kt[d];
            scores[g * TILE + t] = softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
        }
    }
    for (int g = 0; g < group; g++) {
        float *p = scores + g * TILE, *acc = st->acc + g * head_dim;
        float tile_max = st->max[g], sum = 0.0f;
        for (int t = 0; t < count; t++)
            tile_max = p[t] > tile_max ? p[t] : tile_max;
        float rescale = exp_clamped(st->max[g] - tile_max);
        for (int t = 0; t < count; t++) {
            p[t] = exp_clamped(p[t] - tile_max);
            sum += p[t];
        }
        st->sum[g] = st->sum[g] * rescale + sum;
        st->max[g] = tile_max;
        if (rescale != 1.0f)
            for (int d = 0; d < head_dim; d++)
                acc[d] *= rescale;
        for (int t = 0; t < count; t++) {
            const float *vt = v + t * head_dim;
            float pt = p[t];
            for (int d = 0; d < head_dim; d++)
                acc[d] += pt * vt[d];
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load16(const char *src, int dtype)
{
    if (dtype == TS_BFLOAT16) {
        __m256i half = _mm256_loadu_si256((const __m256i *)src);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_loadu_ps((const float *)src);
}

/* The tile in 16-lane vectors, converted once for every query row that attends to it. */
struct tile_avx512 {
    __m512 k[TILE * MAX_HEAD_DIM / 16], v[TILE * MAX_HEAD_DIM / 16];
};

static inline __attribute__((always_inline)) void load_tile_avx512(struct tile_avx512 *tile,
        const char *const *rows, int64_t head_offset, const struct paged_cache *c, int count, int head_dim)
{
    const int chunks = head_dim / 16, step = 16 * c->elem;
    for (int t = 0; t < count; t++)
        for (int j = 0; j < chunks; j++) {
            tile->k[t * chunks + j] = load16(rows[t] + head_offset + j * step, c->dtype);
            tile->v[t * chunks + j] = load16(rows[t] + head_offset + c->kv_stride + j * step, c->dtype);
        }
}

/* attend_tile_scalar with 16-lane vectors: the tile's scores reduced together, the softmax on one
 * vector, the output accumulated in registers. */
static inline __attribute__((always_inline)) void attend_tile_avx512(struct group_state *st,
        const struct tile_avx512 *tile, int count, int group, int head_dim)
{
    const int chunks = head_dim / 16;
    const __m512 *k = tile->k, *v = tile->v;
    const __mmask16 live = (__mmask16)((1u << count) - 1u);
    for (int g = 0; g < group; g++) {
        const float *q = st->q + g * head_dim;
        float *acc = st->acc + g * head_dim;
        __m512 dots[TILE];
        for (int t = 0; t < TILE; t++) {
            __m512 d = _mm512_setzero_ps();
            if (t < count)
                for (int j = 0; j < chunks; j++)
                    d = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * j), k[t * chunks + j], d);
            dots[t] = d;
        }
        __m512 scores = _mm512_mask_blend_ps(live, _mm512_set1_ps(-3.0e38f), sum16(dots));
        float tile_max = _mm512_reduce_max_ps(scores);
        tile_max = tile_max > st->max[g] ? tile_max : st->max[g];
        float rescale = exp_clamped(st->max[g] - tile_max);
        __m512 probs = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(tile_max))));
        st->sum[g] = st->sum[g] * rescale + _mm512_reduce_add_ps(probs);
        st->max[g] = tile_max;
        float p[TILE];
        _mm512_storeu_ps(p, probs);
        for (int j = 0; j < chunks; j++) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), _mm512_set1_ps(rescale));
            for (int t = 0; t < count; t++)
                a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), v[t * chunks + j], a);
            _mm512_storeu_ps(acc + 16 * j, a);
        }
    }
}

#if defined(__AVX512BF16__)
#define TS_BF16_TILES 1
/* A bfloat16 tile as vdpbf16ps reads it, built once for every query row: the keys as stored
 * (32 elements a vector), the values interleaved by token pairs (pair p's vector holds
 * (v[2p][d], v[2p+1][d]) for 16 dimensions d; see bf16_acc_dim for which). */
struct tile_bf16 {
    __m512i k[TILE * MAX_HEAD_DIM / 32], v[TILE * MAX_HEAD_DIM / 32];
};

static inline __attribute__((always_inline)) void load_tile_bf16(struct tile_bf16 *tile, const char *const *rows,
        int64_t head_offset, const struct paged_cache *c, int count, int head_dim)
{
    const int chunks = head_dim / 32;
    for (int t = 0; t < count; t++)
        for (int j = 0; j < chunks; j++)
            tile->k[t * chunks + j] = _mm512_loadu_si512((const void *)(rows[t] + head_offset + j * 64));
    for (int t = 0; t < count; t += 2)
        for (int j = 0; j < chunks; j++) {
            const char *first = rows[t] + head_offset + c->kv_stride + j * 64;
            __m512i a = _mm512_loadu_si512((const void *)first), b = _mm512_setzero_si512();
            if (t + 1 < count)
                b = _mm512_loadu_si512((const void *)(rows[t + 1] + head_offset + c->kv_stride + j * 64));
            tile->v[(t / 2 * chunks + j) * 2] = _mm512_unpacklo_epi16(a, b);
            tile->v[(t / 2 * chunks + j) * 2 + 1] = _mm512_unpackhi_epi16(a, b);
        }
}

/* attend_tile_avx512 on bfloat16 tiles: scores by vdpbf16ps over the stored query and keys (float32
 * sums, scaled after), probabilities rounded to bfloat16 for their product with the values (as
 * PyTorch's bfloat16 kernels and flash_prefill.c do). The accumulator comes out in the values'
 * interleaved order (bf16_acc_dim); bf16_unpermute puts it back. */
static inline __attribute__((always_inline)) void attend_tile_bf16(struct group_state *st,
        const struct tile_bf16 *tile, int count, int group, int head_dim)
{
    const int chunks = head_dim / 32, pairs = (count + 1) / 2;
    const __mmask16 live = (__mmask16)((1u << count) - 1u);
    for (int g = 0; g < group; g++) {
        float *acc = st->acc + g * head_dim;
        __m512bh q[MAX_HEAD_DIM / 32];
        for (int j = 0; j < chunks; j++)
            q[j] = (__m512bh)_mm512_loadu_si512((const void *)(st->qb + g * head_dim + 32 * j));
        __m512 dots[TILE];
        for (int t = 0; t < TILE; t++) {
            __m512 d = _mm512_setzero_ps();
            if (t < count)
                for (int j = 0; j < chunks; j++)
                    d = _mm512_dpbf16_ps(d, q[j], (__m512bh)tile->k[t * chunks + j]);
            dots[t] = d;
        }
        __m512 scores = _mm512_mask_blend_ps(live, _mm512_set1_ps(-3.0e38f),
                                             _mm512_mul_ps(sum16(dots), _mm512_set1_ps(st->scale)));
        float tile_max = _mm512_reduce_max_ps(scores);
        tile_max = tile_max > st->max[g] ? tile_max : st->max[g];
        float rescale = exp_clamped(st->max[g] - tile_max);
        __m512 probs = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(tile_max))));
        st->sum[g] = st->sum[g] * rescale + _mm512_reduce_add_ps(probs);
        st->max[g] = tile_max;
        uint32_t p[TILE / 2];
        _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(probs));
        for (int j = 0; j < 2 * chunks; j++) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), _mm512_set1_ps(rescale));
            for (int i = 0; i < pairs; i++)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32((int)p[i]),
                                     (__m512bh)tile->v[(i * chunks + j / 2) * 2 + j % 2]);
            _mm512_storeu_ps(acc + 16 * j, a);
        }
    }
}

/* The dimension the bfloat16 path's accumulator holds at index i: unpacklo/unpackhi of 16-bit
 * elements work within 128-bit lanes, so of each 32 dimensions the first vector holds 0-3, 8-11,
 * 16-19, 24-27 and the second 4-7, 12-15, 20-23, 28-31. */
static inline int bf16_acc_dim(int i)
{
    int chunk = i / 32, half = (i / 16) % 2, lane = i % 16;
    return chunk * 32 + (lane / 4) * 8 + half * 4 + lane % 4;
}

/* A row's accumulator from the bfloat16 path's order back to the dimensions' own. */
static void bf16_unpermute(float *acc, int head_dim)
{
    float natural[MAX_HEAD_DIM];
    for (int i = 0; i < head_dim; i++)
        natural[bf16_acc_dim(i)] = acc[i];
    memcpy(acc, natural, sizeof(float) * head_dim);
}
#endif
#endif

/* Whether a bfloat16 cache's tiles of this head size take the bfloat16 path (vdpbf16ps, keys and
 * values as stored) when the scores are not soft-capped. */
int ts_paged_bf16_tiles(int head_dim)
{
#if defined(TS_BF16_TILES)
    return head_dim % 32 == 0 && head_dim <= MAX_HEAD_DIM && TILE == 16;
#else
    (void)head_dim;
    return 0;
#endif
}

static inline int bf16_tiles(const struct paged_cache *c, int head_dim, float softcap)
{
    return c->dtype == TS_BFLOAT16 && softcap <= 0.0f && ts_paged_bf16_tiles(head_dim);
}

/* One tile of one KV head for the `nrows` query rows of a unit (consecutive tokens of one
 * sequence): loaded once, folded into each row's state with that row's count of visible keys (a
 * row's causal end may cut the tile short; a row that sees none of it is skipped). */
static inline __attribute__((always_inline)) void attend_tile(struct group_state *const *states, int nrows,
        const int *counts, const char *const *rows, int64_t head_offset, const struct paged_cache *c, int count,
        int group, int head_dim, float softcap)
{
#if defined(TS_BF16_TILES)
    if (bf16_tiles(c, head_dim, softcap)) {
        struct tile_bf16 tile;
        load_tile_bf16(&tile, rows, head_offset, c, count, head_dim);
        for (int r = 0; r < nrows; r++)
            if (counts[r] > 0)
                attend_tile_bf16(states[r], &tile, counts[r], group, head_dim);
        return;
    }
#endif
#if defined(__AVX512F__)
    if (head_dim % 16 == 0 && TILE == 16 && softcap <= 0.0f) {
        struct tile_avx512 tile;
        load_tile_avx512(&tile, rows, head_offset, c, count, head_dim);
        for (int r = 0; r < nrows; r++)
            if (counts[r] > 0)
                attend_tile_avx512(states[r], &tile, counts[r], group, head_dim);
        return;
    }
#endif
    struct tile_scalar tile;
    load_tile_scalar(&tile, rows, head_offset, c, count, head_dim);
    for (int r = 0; r < nrows; r++)
        if (counts[r] > 0)
            attend_tile_scalar(states[r], &tile, counts[r], group, head_dim, softcap);
}

/* Attention of a unit's query rows (`nrows` consecutive tokens of one paged sequence, row r seeing
 * keys [start, ends[r])) for KV heads [first_head, first_head + heads), TILE keys at a time whatever
 * the block size (a tile may span blocks). Each tile of each head is read and converted once for
 * all the unit's rows; a token's heads are read together (one contiguous run of memory). Row r's
 * state for head h is states[r * heads + h]. */
static inline __attribute__((always_inline)) void attend_range(struct group_state *states, int nrows,
        const int64_t *ends, const struct paged_cache *c, const int64_t *table, int64_t start, int first_head,
        int heads, int group, int head_dim, float softcap)
{
    for (int s = 0; s < nrows * heads; s++)
        for (int g = 0; g < group; g++) {
            states[s].max[g] = -3.0e38f;
            states[s].sum[g] = 0.0f;
            memset(states[s].acc + g * head_dim, 0, sizeof(float) * head_dim);
        }
    const int64_t end = ends[nrows - 1];
    struct token_cursor cur = cursor_at(c, table, start);
    int64_t ahead_pos = start + TILE + PREFETCH_DISTANCE;
    struct token_cursor ahead = cursor_at(c, table, ahead_pos < end ? ahead_pos : end);
    const int64_t first_offset = (int64_t)first_head * c->head_stride;
    for (int64_t pos = start; pos < end;) {
        int count = end - pos < TILE ? (int)(end - pos) : TILE;
        const char *rows[TILE];
        for (int t = 0; t < count; t++)
            rows[t] = cursor_next(&cur, c) + first_offset;
        int ahead_rows = 0;
        const char *ahead_row[TILE];
        for (; ahead_rows < TILE && ahead_pos < end; ahead_rows++, ahead_pos++)
            ahead_row[ahead_rows] = cursor_next(&ahead, c) + first_offset;
        int counts[QUERY_BLOCK];
        for (int r = 0; r < nrows; r++) {
            int64_t seen = ends[r] - pos;
            counts[r] = seen <= 0 ? 0 : (seen < count ? (int)seen : count);
        }
        for (int h = 0; h < heads; h++) {
            /* a share of the rows to prefetch before each head's tile, spreading the requests */
            for (int t = h * TILE / heads; t < (h + 1) * TILE / heads && t < ahead_rows; t++)
                prefetch_row(ahead_row[t], c->kv_stride, heads * c->head_stride);
            struct group_state *unit[QUERY_BLOCK];
            for (int r = 0; r < nrows; r++)
                unit[r] = states + r * heads + h;
            attend_tile(unit, nrows, counts, rows, h * c->head_stride, c, count, group, head_dim, softcap);
        }
        pos += count;
    }
#if defined(TS_BF16_TILES)
    if (bf16_tiles(c, head_dim, softcap))
        for (int s = 0; s < nrows * heads; s++)
            for (int g = 0; g < group; g++)
                bf16_unpermute(states[s].acc + g * head_dim, head_dim);
#endif
}

/* attend_range with the head size known to the compiler for the common sizes (whole-vector loops). */
static void attend_range_any(struct group_state *states, int nrows, const int64_t *ends, const struct paged_cache *c,
                             const int64_t *table, int64_t start, int first_head, int heads, int group, int head_dim,
                             float softcap)
{
    switch (head_dim) {
    case 64: attend_range(states, nrows, ends, c, table, start, first_head, heads, group, 64, softcap); break;
    case 128: attend_range(states, nrows, ends, c, table, start, first_head, heads, group, 128, softcap); break;
    default: attend_range(states, nrows, ends, c, table, start, first_head, heads, group, head_dim, softcap);
    }
}

/* The rows cut into units: runs of at most QUERY_BLOCK consecutive tokens of one sequence (same
 * blocks, causal lengths one apart: a prefill chunk's rows), which share their reads of the cache;
 * every other row is a unit of its own (a decode; any row under a sliding window). Returns the
 * number of units; unit u is rows [firsts[u], firsts[u + 1]). */
static int64_t query_units(const int64_t *block_starts, const int64_t *context_lens, int64_t rows, int64_t window,
                           int64_t *firsts)
{
    int64_t units = 0;
    for (int64_t row = 0; row < rows; row++) {
        int joins = row > 0 && window <= 0 && row - firsts[units - 1] < QUERY_BLOCK
                    && block_starts[row] == block_starts[row - 1] && context_lens[row] == context_lens[row - 1] + 1;
        if (!joins)
            firsts[units++] = row;
    }
    firsts[units] = rows;
    return units;
}

/* Attention straight from the paged cache (no gather): query row i (one token: a decode, or one
 * token of a prefill chunk with its causal length) attends
 * to the first context_lens[i] tokens of its sequence (the last `window` of them if window > 0),
 * its scores soft-capped (softcap * tanh(score / softcap)) if softcap > 0,
 * whose block ids are block_ids[block_starts[i] ...]. q: rows of num_heads * head_dim elements,
 * `q_row_stride` elements apart (heads contiguous); out: [rows, num_heads, head_dim] contiguous.
 * Units of rows (query_units) are shared out last first (the runner sorts decode rows by length,
 * shortest first), each with all its KV heads, or one KV head per task when there are too few
 * units to keep the threads busy. Returns 0, -1 for shapes beyond the kernel's limits (the caller
 * checks them first), -2 when out of memory. */
int ts_paged_attention(const void *q, int64_t q_row_stride, const void *cache, int64_t block_stride,
                    int64_t kv_stride, int64_t token_stride, int64_t head_stride, int block_size,
                    const int64_t *block_ids, const int64_t *block_starts, const int64_t *context_lens,
                    int64_t rows, int num_heads, int num_kv_heads, int head_dim, float scale,
                    int64_t window, float softcap, int dtype, void *out)
{
    int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads)
        return -1;
    int elem = dtype == TS_BFLOAT16 ? 2 : 4;
    struct paged_cache c = {(const char *)cache, block_stride * elem, kv_stride * elem, token_stride * elem,
                            head_stride * elem, block_size, dtype, elem};
    int64_t *firsts = malloc(sizeof(int64_t) * (rows + 1));
    if (firsts == NULL)
        return -2;
    int64_t units = query_units(block_starts, context_lens, rows, window, firsts);
    const int bf16_path = bf16_tiles(&c, head_dim, softcap);
    const int decode_path = paged_decode_supported(&c, group, head_dim, softcap);
    int heads = units >= 4 * omp_get_max_threads() ? num_kv_heads : 1;
    int64_t spans = num_kv_heads / heads, tasks = units * spans;
    int failed = 0;
#pragma omp parallel
    {
        struct group_state *states = new_states(heads * QUERY_BLOCK, group, head_dim);
        if (states == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (states == NULL)
                continue;
            int64_t unit = units - 1 - task / spans, first_row = firsts[unit];
            int nrows = (int)(firsts[unit + 1] - first_row);
            int first_head = (int)(task % spans) * heads;
            int64_t first_q = (int64_t)first_head * group;
            if (nrows == 1 && decode_path) {
                int64_t end = context_lens[first_row], start = window > 0 && end > window ? end - window : 0;
                paged_decode_row((const uint16_t *)q + first_row * q_row_stride, &c, block_ids + block_starts[first_row],
                                 start, end, first_head, heads, group, head_dim, scale,
                                 (uint16_t *)out + first_row * num_heads * head_dim);
                continue;
            }
            for (int r = 0; r < nrows; r++) {
                const char *q_row = (const char *)q + ((first_row + r) * q_row_stride + first_q * head_dim) * elem;
                for (int h = 0; h < heads; h++) {
                    struct group_state *st = states + r * heads + h;
                    st->scale = scale;
                    for (int g = 0; g < group; g++) {
                        const char *src = q_row + (int64_t)(h * group + g) * head_dim * elem;
                        if (bf16_path)  /* read as stored, the scale applied to the scores */
                            memcpy(st->qb + g * head_dim, src, sizeof(uint16_t) * head_dim);
                        else
                            load_row(src, dtype, st->q + g * head_dim, head_dim, scale);
                    }
                }
            }
            const int64_t *ends = context_lens + first_row;
            int64_t start = window > 0 && ends[0] > window ? ends[0] - window : 0;
            attend_range_any(states, nrows, ends, &c, block_ids + block_starts[first_row], start, first_head, heads,
                             group, head_dim, softcap);
            for (int r = 0; r < nrows; r++) {
                char *out_row = (char *)out + ((first_row + r) * num_heads + first_q) * head_dim * elem;
                for (int h = 0; h < heads; h++)
                    for (int g = 0; g < group; g++)
                        store_row(out_row + (int64_t)(h * group + g) * head_dim * elem, dtype,
                                  states[r * heads + h].acc + g * head_dim, head_dim,
                                  1.0f / states[r * heads + h].sum[g]);
            }
        }
        free(states);
    }
    free(firsts);
    return failed ? -2 : 0;
}

/* ---- elementwise layers, one pass each, rounding as PyTorch's op-by-op versions do ---------- */

static inline float f32_load(const float *p) { return *p; }
static inline void f32_store(float *p, float x) { *p = x; }
static inline float f32_round(float x) { return x; }
static inline float bf16_load(const uint16_t *p) { return bf16_to_float(*p); }
static inline void bf16_store(uint16_t *p, float x) { *p = float_to_bf16(x); }
static inline float bf16_round(float x) { return bf16_to_float(float_to_bf16(x)); }

/* One row of each elementwise layer, for element type T (LOAD, STORE and ROUND of that type). */
#define DEFINE_ROW_KERNELS(SUFFIX, T, LOAD, STORE, ROUND)                                           \
static void rms_norm_row_##SUFFIX(const T *src, T *res, const T *weight, T *dst, int64_t size,      \
                                  float eps)                                                        \
{                                                                                                   \
    float squares = 0.0f;                                                                           \
    if (res != NULL) {                                                                              \
        _Pragma("omp simd reduction(+ : squares)")                                                  \
        for (int64_t i = 0; i < size; i++) {                                                        \
            float v = ROUND(LOAD(src + i) + LOAD(res + i));                                         \
            STORE(res + i, v);                                                                      \
            squares += v * v;                                                                       \
        }                                                                                           \
        src = res;                                                                                  \
    } else {                                                                                        \
        _Pragma("omp simd reduction(+ : squares)")                                                  \
        for (int64_t i = 0; i < size; i++)                                                          \
            squares += LOAD(src + i) * LOAD(src + i);                                               \
    }                                                                                               \
    float inv = 1.0f / __builtin_sqrtf(squares / (float)size + eps);                                \
    for (int64_t i = 0; i < size; i++)                                                              \
        STORE(dst + i, LOAD(weight + i) * ROUND(LOAD(src + i) * inv));                              \
}                                                                                                   \
                                                                                                    \
static void silu_mul_row_##SUFFIX(const T *gate, const T *up, T *dst, int64_t size)                 \
{                                                                                                   \
    float e[SILU_TILE];                                                                             \
    for (int64_t start = 0; start < size; start += SILU_TILE) {                                     \
        int64_t n = size - start < SILU_TILE ? size - start : SILU_TILE;                            \
        const T *g = gate + start, *u = up + start;                                                 \
        for (int64_t i = 0; i < n; i++)                                                             \
            e[i] = exp_clamped(-LOAD(g + i));                                                       \
        for (int64_t i = 0; i < n; i++)                                                             \
            STORE(dst + start + i, ROUND(LOAD(g + i) / (1.0f + e[i])) * LOAD(u + i));               \
    }                                                                                               \
}                                                                                                   \
                                                                                                    \
static void rotary_head_##SUFFIX(T *head, const float *cos_row, const float *sin_row, int half)     \
{                                                                                                   \
    for (int i = 0; i < half; i++) {                                                                \
        float a = LOAD(head + i), b = LOAD(head + i + half);                                        \
        float ra = ROUND(a * ROUND(cos_row[i])) + ROUND(-b * ROUND(sin_row[i]));                    \
        float rb = ROUND(b * ROUND(cos_row[i + half])) + ROUND(a * ROUND(sin_row[i + half]));       \
        STORE(head + i, ra);                                                                        \
        STORE(head + i + half, rb);                                                                 \
    }                                                                                               \
}

DEFINE_ROW_KERNELS(f32, float, f32_load, f32_store, f32_round)
DEFINE_ROW_KERNELS(bf16, uint16_t, bf16_load, bf16_store, bf16_round)

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* RMSNorm's and rotary's bfloat16 rows on 16 lanes at a time, with the scalar rows' roundings (whose
 * loops GCC left scalar: a 1k-token prefill of a 1024-wide model spent 0.21 ms in each fused norm
 * and 0.40 a layer in rotary; now 0.12 and 0.14, a Zen 5 EPYC). silu * up stays the scalar rows': a
 * 16-lane version (its exp and division per vector) ran 0.84 ms against their 0.65. */
#define TS_BF16_ROWS16 1

/* rms_norm_row_bf16 on 16 lanes: the same roundings; the squares summed per lane, then across */
static void rms_norm_row_bf16x16(const uint16_t *src, uint16_t *res, const uint16_t *weight, uint16_t *dst,
                                 int64_t size, float eps)
{
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < size; i += 16) {
        __mmask16 m = lanes_below(size - i);
        __m512 v = bf16x16_load(src + i, m);
        if (res != NULL) {
            v = bf16x16_round(_mm512_add_ps(v, bf16x16_load(res + i, m)));
            bf16x16_store(res + i, v, m);
        }
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    src = res != NULL ? res : src;
    __m512 inv = _mm512_set1_ps(1.0f / __builtin_sqrtf(_mm512_reduce_add_ps(squares) / (float)size + eps));
    for (int64_t i = 0; i < size; i += 16) {
        __mmask16 m = lanes_below(size - i);
        __m512 normed = bf16x16_round(_mm512_mul_ps(bf16x16_load(src + i, m), inv));
        bf16x16_store(dst + i, _mm512_mul_ps(bf16x16_load(weight + i, m), normed), m);
    }
}

#define RMS_NORM_ROW_BF16 rms_norm_row_bf16x16
#define ROTARY_MAX_HALF 256

/* One row's heads (contiguous): the row's cos and sin rounded once, then each head rotated. */
static void rotary_row_bf16x16(uint16_t *row, int heads, int half, const float *cos_row, const float *sin_row)
{
    __m512 c0[ROTARY_MAX_HALF / 16], c1[ROTARY_MAX_HALF / 16], s0[ROTARY_MAX_HALF / 16], s1[ROTARY_MAX_HALF / 16];
    int vectors = (half + 15) / 16;
    for (int v = 0; v < vectors; v++) {
        __mmask16 m = lanes_below(half - 16 * v);
        c0[v] = bf16x16_round(_mm512_maskz_loadu_ps(m, cos_row + 16 * v));
        c1[v] = bf16x16_round(_mm512_maskz_loadu_ps(m, cos_row + half + 16 * v));
        s0[v] = bf16x16_round(_mm512_maskz_loadu_ps(m, sin_row + 16 * v));
        s1[v] = bf16x16_round(_mm512_maskz_loadu_ps(m, sin_row + half + 16 * v));
    }
    for (int h = 0; h < heads; h++) {
        uint16_t *head = row + (int64_t)h * 2 * half;
        for (int v = 0; v < vectors; v++) {
            __mmask16 m = lanes_below(half - 16 * v);
            __m512 a = bf16x16_load(head + 16 * v, m), b = bf16x16_load(head + half + 16 * v, m);
            __m512 ra = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(a, c0[v])),
                                      bf16x16_round(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b), s0[v])));
            __m512 rb = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(b, c1[v])), bf16x16_round(_mm512_mul_ps(a, s1[v])));
            bf16x16_store(head + 16 * v, ra, m);
            bf16x16_store(head + half + 16 * v, rb, m);
        }
    }
}
#endif

#if !defined(RMS_NORM_ROW_BF16)
#define RMS_NORM_ROW_BF16 rms_norm_row_bf16
#endif
#define ELEMENTWISE_PARALLEL_FROM 32768  /* elements: below, one thread (no fork/join) */

/* RMSNorm of each row of x ([rows, size], rows `x_stride` elements apart) into out (contiguous):
 * out = round(weight * round(x * rsqrt(mean(x^2) + eps))), in float32. With `residual`
 * (contiguous, like out), first residual = round(x + residual), and that sum is normalised.
 * The weight has x's type. */
void ts_rms_norm(const void *x, int64_t x_stride, void *residual, const void *weight, void *out, int64_t rows,
                 int64_t size, float eps, int dtype)
{
#pragma omp parallel for schedule(static) if (rows * size > ELEMENTWISE_PARALLEL_FROM)
    for (int64_t row = 0; row < rows; row++) {
        if (dtype == TS_BFLOAT16)
            RMS_NORM_ROW_BF16((const uint16_t *)x + row * x_stride,
                              residual == NULL ? NULL : (uint16_t *)residual + row * size,
                              (const uint16_t *)weight, (uint16_t *)out + row * size, size, eps);
        else
            rms_norm_row_f32((const float *)x + row * x_stride,
                             residual == NULL ? NULL : (float *)residual + row * size,
                             (const float *)weight, (float *)out + row * size, size, eps);
    }
}

/* SwiGLU's activation: out[r, i] = round(round(silu(gate)) * up), where gate_up's row r holds
 * the gates then the ups (`size` each, rows `in_stride` elements apart); out is [rows, size]. */
void ts_silu_mul(const void *gate_up, int64_t in_stride, void *out, int64_t rows, int64_t size, int dtype)
{
#pragma omp parallel for schedule(static) if (rows * size > ELEMENTWISE_PARALLEL_FROM)
    for (int64_t row = 0; row < rows; row++) {
        if (dtype == TS_BFLOAT16) {
            const uint16_t *gate = (const uint16_t *)gate_up + row * in_stride;
            silu_mul_row_bf16(gate, gate + size, (uint16_t *)out + row * size, size);
        } else {
            const float *gate = (const float *)gate_up + row * in_stride;
            silu_mul_row_f32(gate, gate + size, (float *)out + row * size, size);
        }
    }
}

/* Rotary embedding (rotate-half) in place on x: [rows, heads, head_dim], rows `x_stride` elements
 * apart, heads contiguous. cos/sin: float32 tables [max_positions, head_dim], rounded to x's type
 * as PyTorch's version casts them; x = round(round(x * cos) + round(rotate_half(x) * sin)). */
void ts_rotary(void *x, int64_t x_stride, const int64_t *positions, const float *cos_table,
               const float *sin_table, int64_t rows, int heads, int head_dim, int dtype)
{
#pragma omp parallel for schedule(static) if (rows * heads * head_dim > ELEMENTWISE_PARALLEL_FROM)
    for (int64_t row = 0; row < rows; row++) {
        const float *cos_row = cos_table + positions[row] * head_dim;
        const float *sin_row = sin_table + positions[row] * head_dim;
#if defined(TS_BF16_ROWS16)
        if (dtype == TS_BFLOAT16 && head_dim / 2 <= ROTARY_MAX_HALF) {
            rotary_row_bf16x16((uint16_t *)x + row * x_stride, heads, head_dim / 2, cos_row, sin_row);
            continue;
        }
#endif
        for (int h = 0; h < heads; h++) {
            int64_t offset = row * x_stride + (int64_t)h * head_dim;
            if (dtype == TS_BFLOAT16)
                rotary_head_bf16((uint16_t *)x + offset, cos_row, sin_row, head_dim / 2);
            else
                rotary_head_f32((float *)x + offset, cos_row, sin_row, head_dim / 2);
        }
    }
}

/* The step's keys and values into the paged cache: token i's rows (kv_heads * head_dim elements,
 * heads contiguous; k and v rows `k_stride` / `v_stride` elements apart) go to slot slots[i]
 * (block slots[i] / block_size, offset slots[i] % block_size) of the layer's cache view. */
void ts_write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *cache,
                 int64_t block_stride, int64_t kv_stride, int64_t token_stride, int block_size,
                 const int64_t *slots, int64_t rows, int64_t row_elems, int dtype)
{
    int elem = dtype == TS_BFLOAT16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * row_elems > ELEMENTWISE_PARALLEL_FROM)
    for (int64_t i = 0; i < rows; i++) {
        char *key = (char *)cache + ((slots[i] / block_size) * block_stride + (slots[i] % block_size) * token_stride) * elem;
        memcpy(key, (const char *)k + i * k_stride * elem, row_elems * elem);
        memcpy(key + kv_stride * elem, (const char *)v + i * v_stride * elem, row_elems * elem);
    }
}
