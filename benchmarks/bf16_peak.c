/* This CPU's ceiling for bfloat16 products: `vdpbf16ps` (16 float32 lanes, each += two products:
 * 64 FLOP an instruction), and for the 16-bit integer products of the packed int8/4-bit kernels
 * (`vpdpwssd`, as many: csrc/int4_linear.c's rows as 16-bit integers), in the bf16 linear kernel's tile (csrc/bf16_linear.c: 6 rows x 4 vectors of
 * 16 channels, 24 accumulators), each pair of a row's inputs broadcast from memory and the weights
 * loaded from a buffer of the given size, cycled (16 KiB: L1; 128 KiB: L2, the kernel's span of a
 * block; 8 MiB: beyond L2). On every OpenMP thread (OMP_NUM_THREADS). A linear layer's GFLOP/s over
 * this figure is how near the CPU's peak it runs.
 *
 *     cc -O2 -march=native -fopenmp benchmarks/bf16_peak.c -o /tmp/bf16_peak && /tmp/bf16_peak
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define K 1024
#define STEPS 20000000L
#define DP(acc, x, w)                                                                                 \
    do {                                                                                              \
        if (integer)                                                                                  \
            __asm__ volatile("vpdpwssd %1, %2, %0" : "+v"(acc) : "v"(w), "v"(x));                    \
        else                                                                                          \
            __asm__ volatile("vdpbf16ps %1, %2, %0" : "+v"(acc) : "v"(w), "v"(x));                   \
    } while (0)
#define ROW(r, A, B, C, D)                                                                            \
    {                                                                                                 \
        int32_t pair;                                                                                 \
        memcpy(&pair, rows + (r) * K + k, sizeof pair);                                               \
        __m512 x = _mm512_castsi512_ps(_mm512_set1_epi32(pair));                                      \
        DP(A, x, w0); DP(B, x, w1); DP(C, x, w2); DP(D, x, w3);                                       \
    }

/* (24 named accumulators: GCC keeps them in registers, an array it loads and stores at each step;
 * `integer` a constant at each call, so each instruction's loop is its own) */
static inline __attribute__((always_inline)) float tile_steps(const uint16_t *weights, long weight_elems,
                                                              const uint16_t *rows, int integer)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0, a16 = a0, a17 = a0, a18 = a0,
           a19 = a0, a20 = a0, a21 = a0, a22 = a0, a23 = a0;
    long at = 0;
    int k = 0;
    for (long s = 0; s < STEPS; s++) {
        const uint16_t *w = weights + at;
        __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 32), w2 = _mm512_loadu_ps(w + 64),
               w3 = _mm512_loadu_ps(w + 96);
        ROW(0, a0, a1, a2, a3) ROW(1, a4, a5, a6, a7) ROW(2, a8, a9, a10, a11)
        ROW(3, a12, a13, a14, a15) ROW(4, a16, a17, a18, a19) ROW(5, a20, a21, a22, a23)
        at = at + 128 < weight_elems ? at + 128 : 0;
        k = k + 2 < K ? k + 2 : 0;
    }
    __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                               _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)),
                                           _mm512_add_ps(_mm512_add_ps(a12, a13), _mm512_add_ps(a14, a15))));
    sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a16, a17), _mm512_add_ps(a18, a19)),
                                           _mm512_add_ps(_mm512_add_ps(a20, a21), _mm512_add_ps(a22, a23))));
    return _mm512_reduce_add_ps(sum);
}

static float bf16_steps(const uint16_t *weights, long weight_elems, const uint16_t *rows)
{
    return tile_steps(weights, weight_elems, rows, 0);
}

static float int16_steps(const uint16_t *weights, long weight_elems, const uint16_t *rows)
{
    return tile_steps(weights, weight_elems, rows, 1);
}

int main(void)
{
    const long sizes[] = {16 << 10, 128 << 10, 8 << 20};
    const char *names[] = {"vdpbf16ps", "vpdpwssd "};
    float (*steps[])(const uint16_t *, long, const uint16_t *) = {bf16_steps, int16_steps};
    for (int i = 0; i < 6; i++) {
        double best = 0;
        for (int rep = 0; rep < 3; rep++) {
            double start = omp_get_wtime();
#pragma omp parallel
            {
                uint16_t *weights = aligned_alloc(64, sizes[i % 3]), *rows = aligned_alloc(64, 6 * K * 2);
                memset(weights, 1, sizes[i % 3]);
                memset(rows, 1, 6 * K * 2);
                volatile float sink = steps[i / 3](weights, sizes[i % 3] / 2, rows);
                (void)sink;
                free(weights);
                free(rows);
            }
            double flops = 64.0 * 24 * STEPS * omp_get_max_threads(), rate = flops / (omp_get_wtime() - start);
            best = rate > best ? rate : best;
        }
        printf("%s, 6 x 4 tile, weights cycled over %5ld KiB: %5.0f GFLOP/s on %d threads\n", names[i / 3],
               sizes[i % 3] >> 10, best / 1e9, omp_get_max_threads());
    }
    return 0;
}
