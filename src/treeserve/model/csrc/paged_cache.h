/* One layer's paged KV cache as the attention kernels walk it (cpu_kernels.c, paged_decode.c). */
#ifndef TS_PAGED_CACHE_H
#define TS_PAGED_CACHE_H

#include <stdint.h>

struct paged_cache {
    const char *base;       /* one layer's [num_blocks, 2, block_size, kv_heads, head_dim] view */
    int64_t block_stride;   /* strides in bytes */
    int64_t kv_stride;
    int64_t token_stride;
    int64_t head_stride;
    int block_size;
    int dtype;
    int elem;               /* bytes per element */
};

/* A walk over a paged sequence's tokens in order: the block table entry and the offset in it,
 * advanced without a division per token. */
struct token_cursor {
    const int64_t *table;
    int64_t block;
    int offset;
};

static inline struct token_cursor cursor_at(const struct paged_cache *c, const int64_t *table, int64_t pos)
{
    struct token_cursor cur = {table, pos / c->block_size, (int)(pos % c->block_size)};
    return cur;
}

/* The cursor's token's row (first KV head's key), then one token on. */
static inline const char *cursor_next(struct token_cursor *cur, const struct paged_cache *c)
{
    const char *row = c->base + cur->table[cur->block] * c->block_stride + cur->offset * c->token_stride;
    if (++cur->offset == c->block_size) {
        cur->offset = 0;
        cur->block++;
    }
    return row;
}

/* One token's key and value rows (`bytes` each, `kv_stride` apart) towards L2. */
static inline void prefetch_row(const char *key, int64_t kv_stride, int64_t bytes)
{
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(key + b, 0, 1);
        __builtin_prefetch(key + kv_stride + b, 0, 1);
    }
}

#endif
