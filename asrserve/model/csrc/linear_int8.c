/* y = x W^T + b, then GELU or plus a residual, for the encoder's 1500-row products: W in int8
 * (one scale per output), each row of x quantized to uint8 on the way in (one scale and zero
 * point per row), int32 sums by VPDPBUSD (AVX512-VNNI, twice VDPBF16PS's multiplies per
 * instruction), bf16 in and out. Built and loaded by asrserve/model/cpu_linear_int8.py, which
 * says when it runs and what it costs in accuracy.
 *
 * W is packed once as w[block][quad][output][4]: block = output / 16, quad = input / 4, so that
 * one 64-byte load holds four inputs' weights for 16 outputs, and one VPDPBUSD adds the four
 * products of a row's four uint8 inputs to each of 16 int32 sums. The sums are exact, so a
 * row's result depends on nothing but the row (batch invariance), and the row's quantization
 * on nothing but its own values.
 *
 * With x ~ scale_r (q - zero_r) and W ~ w_scale_o w, a sum is
 * scale_r w_scale_o (sum_k q_k w_k - zero_r sum_k w_k): the second term is the row's zero
 * point times the output's weight sum (w_sum, computed at packing).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_tiles.h"
#include "linear_epilogue.h"
#include "vector_math.h"

/* Row x (bf16, n values) -> q (uint8) with x ~ scale (q - zero). The range spans 0, so that 0
 * is exact and a row's zero point is within 0 ... 255. */
static void quantize_row(const uint16_t *x, int64_t n, uint8_t *q, float *scale, int32_t *zero) {
    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        __m512 v = load_bf16x16(x + t, mask16(n - t)); /* masked lanes read 0, inside the range */
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
    }
    const float low = _mm512_reduce_min_ps(lo), high = _mm512_reduce_max_ps(hi);
    const float step = high > low ? (high - low) / 255.0f : 1.0f;
    const float inverse = 1.0f / step;
    const int32_t z = (int32_t)__builtin_nearbyintf(-low * inverse);
    const __m512 scale_by = _mm512_set1_ps(inverse);
    const __m512i shift = _mm512_set1_epi32(z), floor = _mm512_setzero_si512();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = mask16(n - t);
        __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(load_bf16x16(x + t, m), scale_by),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_max_epi32(_mm512_add_epi32(v, shift), floor);
        _mm512_mask_cvtusepi32_storeu_epi8(q + t, m, v); /* saturates at 255 */
    }
    *scale = step;
    *zero = z;
}

/* acc += the four products of each 32-bit lane's uint8 x int8 pairs (VPDPBUSD). Inline asm,
 * as GCC 12 copies the accumulator to another register and back around its intrinsic at every
 * step, and in a 6 x 4 tile spills the copies to the stack (half the speed). */
#define DPBUSD(acc, unsigned_bytes, signed_bytes) \
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(unsigned_bytes), "v"(signed_bytes))

/* sum[r][b] = row r's product with output block b, in float32: the exact int32 sum of the
 * quantized products, less the zero-point term, times the row's and the outputs' scales. */
static inline __attribute__((always_inline)) void int8_tile_sums(__m512 sum[TILE_ROWS][TILE_BLOCKS], const uint8_t *q,
                                                            int64_t in_features, const float *row_scale,
                                                            const int32_t *row_zero, const int8_t *w, int64_t quads,
                                                            const float *w_scale, const int32_t *w_sum, const int rows,
                                                            const int blocks) {
    __m512i acc[TILE_ROWS][TILE_BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) acc[r][b] = _mm512_setzero_si512();
    for (int64_t p = 0; p < quads; p++) {
        __m512i weight[TILE_BLOCKS];
        for (int b = 0; b < blocks; b++) weight[b] = _mm512_loadu_si512(w + (b * quads + p) * 64);
        for (int r = 0; r < rows; r++) {
            const __m512i four = _mm512_set1_epi32(*(const int32_t *)(q + r * in_features + 4 * p));
            for (int b = 0; b < blocks; b++) DPBUSD(acc[r][b], four, weight[b]);
        }
    }
    /* Unrolled by force: left as a loop (its body is too long for GCC's own limit) it indexes
     * acc by a variable, which keeps acc in memory, stored at every step above (half the
     * speed). */
#pragma GCC unroll 4
    for (int b = 0; b < blocks; b++) {
        const __m512 out_scale = _mm512_loadu_ps(w_scale + 16 * b);
        const __m512i weight_sum = _mm512_loadu_si512(w_sum + 16 * b);
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            const __m512i exact = _mm512_sub_epi32(acc[r][b], _mm512_mullo_epi32(_mm512_set1_epi32(row_zero[r]), weight_sum));
            sum[r][b] = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(out_scale, _mm512_set1_ps(row_scale[r])));
        }
    }
}

static inline __attribute__((always_inline)) void tile(const uint8_t *q, int64_t in_features, const float *row_scale,
                                                       const int32_t *row_zero, const int8_t *w, int64_t quads,
                                                       const float *w_scale, const int32_t *w_sum, const float *bias,
                                                       int epilogue, const uint16_t *residual, uint16_t *out,
                                                       int64_t out_features, const int rows, const int blocks) {
    /* q, row_scale, row_zero: the tile's first row; w, w_scale, w_sum, bias: its first block;
     * residual, out: their first row and output. */
    __m512 sum[TILE_ROWS][TILE_BLOCKS];
    int8_tile_sums(sum, q, in_features, row_scale, row_zero, w, quads, w_scale, w_sum, rows, blocks);
    store_tile(sum, bias, epilogue, residual, out, out_features, rows, blocks);
}

/* x [rows][in_features], out and residual [rows][out_features] bf16; w packed as above, with
 * w_scale (float32) and w_sum (int32) [out_features]; bias float32 [out_features] or NULL;
 * epilogue one of EPILOGUE_*. threads: torch's intra-op thread count. Returns 0; 1 when the
 * shapes are not ones it takes (in_features a multiple of 4, out_features of 16) or the epilogue
 * is unknown or lacks its residual; 2 when its scratch memory cannot be had. */
int asrserve_linear_int8(const uint16_t *x, const int8_t *w, const float *w_scale, const int32_t *w_sum, const float *bias, int epilogue,
    const uint16_t *residual, uint16_t *out, int64_t rows, int64_t in_features, int64_t out_features, int threads) {
    if (rows < 0 || in_features <= 0 || in_features % 4 || out_features <= 0 || out_features % 16) return 1;
    if (epilogue < EPILOGUE_NONE || epilogue > EPILOGUE_RESIDUAL || (epilogue == EPILOGUE_RESIDUAL && !residual))
        return 1;
    if (rows == 0) return 0;
    uint8_t *q = malloc((size_t)(rows * in_features));
    float *row_scale = malloc((size_t)rows * sizeof(float));
    int32_t *row_zero = malloc((size_t)rows * sizeof(int32_t));
    if (!q || !row_scale || !row_zero) {
        free(q), free(row_scale), free(row_zero);
        return 2;
    }
    const int64_t quads = in_features / 4, num_blocks = out_features / 16;
    const int64_t row_tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t block_tiles = (num_blocks + TILE_BLOCKS - 1) / TILE_BLOCKS;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            quantize_row(x + r * in_features, in_features, q + r * in_features, row_scale + r, row_zero + r);
        /* As linear_bf16.c: tiles of the same outputs are neighbours in task order. */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < block_tiles * row_tiles; task++) {
            const int64_t block = task / row_tiles * TILE_BLOCKS, row = task % row_tiles * TILE_ROWS;
            const int tile_rows = rows - row < TILE_ROWS ? (int)(rows - row) : TILE_ROWS;
            const int tile_blocks = num_blocks - block < TILE_BLOCKS ? (int)(num_blocks - block) : TILE_BLOCKS;
            const uint8_t *q_tile = q + row * in_features;
            const int8_t *w_tile = w + block * quads * 64;
            const float *bias_tile = bias ? bias + 16 * block : NULL;
            uint16_t *out_tile = out + row * out_features + 16 * block;
            const uint16_t *residual_tile = residual ? residual + row * out_features + 16 * block : NULL;
#define ARGS q_tile, in_features, row_scale + row, row_zero + row, w_tile, quads, w_scale + 16 * block, \
             w_sum + 16 * block, bias_tile
            if (epilogue == EPILOGUE_NONE) {
#define TILE(R, B) tile(ARGS, EPILOGUE_NONE, NULL, out_tile, out_features, R, B)
                DISPATCH_TILE(tile_rows, tile_blocks);
#undef TILE
            } else if (epilogue == EPILOGUE_GELU) {
#define TILE(R, B) tile(ARGS, EPILOGUE_GELU, NULL, out_tile, out_features, R, B)
                DISPATCH_TILE(tile_rows, tile_blocks);
#undef TILE
            } else {
#define TILE(R, B) tile(ARGS, EPILOGUE_RESIDUAL, residual_tile, out_tile, out_features, R, B)
                DISPATCH_TILE(tile_rows, tile_blocks);
#undef TILE
            }
#undef ARGS
        }
    }
    free(q), free(row_scale), free(row_zero);
    return 0;
}
