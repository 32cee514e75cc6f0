/* Decode attention over a bfloat16 paged cache in two passes (paged_decode.c). */
#ifndef TS_PAGED_DECODE_H
#define TS_PAGED_DECODE_H

#include <stdint.h>

#include "paged_cache.h"

/* Query heads per KV head the decode path takes (its accumulators stay in registers). */
#define DECODE_MAX_GROUP 8

/* Whether paged_decode_row serves this cache and head shape (else the tile path does). */
int paged_decode_supported(const struct paged_cache *c, int group, int head_dim, float softcap);

/* One query row (one token, heads contiguous, bfloat16) over keys [start, end) of its sequence
 * (block table `table`) for KV heads [first_head, first_head + heads): the outputs of those
 * heads' query heads written to `out` (the row's num_heads * head_dim bfloat16 elements). */
void paged_decode_row(const uint16_t *q, const struct paged_cache *c, const int64_t *table, int64_t start,
                      int64_t end, int first_head, int heads, int group, int head_dim, float scale, uint16_t *out);

#endif
