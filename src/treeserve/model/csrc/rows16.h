/* bfloat16 rows as 16-bit integers for vpdpwssd (int8_linear.c, int4_linear.c). */
#ifndef TS_ROWS16_H
#define TS_ROWS16_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TS_ROWS16 1

/* acc += pairs of 16-bit products (vpdpwssd). In assembly, as w8a8_linear.c's DPBUSD: GCC 12
 * moves the VNNI intrinsics' accumulators through the stack. */
#define DPWSSD(acc, x, w) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))

/* bfloat16 rows as 16-bit integers, a power of two per span of `span` inputs: x = m * 2^(e - 14)
 * with e the exponent of the span's largest |x|, so |m| < 2^15, and every element within 2^7 of
 * that largest (an 8-bit significand at most 14 binades below) exact; a smaller one is rounded to a
 * multiple of 2^(e - 14), at most 2^-15 of the span's largest (bfloat16 itself rounds that largest
 * by up to 2^-9 of it). */
static inline void rows_to_int16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k_in, int64_t span,
                                 int16_t *dst, float *span_scales, int32_t *span_sums)
{
    const uint16_t *row = x + m * x_stride;
    for (int64_t k0 = 0; k0 < k_in; k0 += span) {
        int64_t k1 = k0 + span < k_in ? k0 + span : k_in;
        __m512 amax = _mm512_setzero_ps();
        __m256i special = _mm256_setzero_si256();   /* exponent bits all set: an infinity or NaN */
        const __m256i exponent = _mm256_set1_epi16(0x7f80);
        for (int64_t k = k0; k < k1; k += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(row + k));
            special = _mm256_or_si256(special, _mm256_cmpeq_epi16(_mm256_and_si256(h, exponent), exponent));
            amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))));
        }
        float largest = _mm512_reduce_max_ps(amax);
        uint32_t bits;
        memcpy(&bits, &largest, sizeof bits);
        int e = (int)(bits >> 23) - 127;
        float up = 0.0f, down = 0.0f;   /* 2^(14 - e) and 2^(e - 14); a span of zeros (or below 2^-112) stays 0 */
        if (!_mm256_testz_si256(special, special)) {
            down = __builtin_nanf("");  /* the span's sums become NaN */
        } else if (largest > 0.0f && e >= -112) {
            uint32_t u = (uint32_t)(127 + 14 - e) << 23, d = (uint32_t)(127 + e - 14) << 23;
            memcpy(&up, &u, sizeof up);
            memcpy(&down, &d, sizeof down);
        }
        span_scales[k0 / span] = down;
        const __m512 s = _mm512_set1_ps(up);
        __m512i total = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(row + k));
            __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)), s);
            __m256i m16 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v));
            total = _mm512_add_epi32(total, _mm512_cvtepi16_epi32(m16));
            _mm256_storeu_si256((__m256i *)(dst + k), m16);
        }
        if (span_sums != NULL)  /* the span's sum of m: zero points' share (int4_linear.c) */
            span_sums[k0 / span] = _mm512_reduce_add_epi32(total);
    }
}
#endif

#endif
