/* Register tiles of a bf16 product with float32 sums, shared by the C kernels that multiply
 * matrices (AVX512-BF16).
 *
 * The right-hand matrix is packed in pairs of inputs for each of 16 outputs:
 * w[block][pair][output][2], block = output / 16, pair = input / 2, so that one 64-byte load
 * holds two inputs' weights for 16 outputs and one VDPBF16PS adds both products to 16 sums. A
 * tile is up to TILE_ROWS rows by up to TILE_BLOCKS blocks of 16 outputs, its sums kept in
 * registers while that part of w streams past once.
 *
 * Each output's sum is its row's products added pair after pair in input order, in one vector
 * lane, whatever the tile it falls in: a row's result does not depend on the rows beside it.
 */
#ifndef ASRSERVE_BF16_TILES_H
#define ASRSERVE_BF16_TILES_H

#include <immintrin.h>
#include <stdint.h>

#define TILE_ROWS 6
#define TILE_BLOCKS 4

/* sum[r][b] = rows r of x (x_stride apart) times output block b of w (pairs pairs each). */
static inline __attribute__((always_inline)) void tile_sums(__m512 sum[TILE_ROWS][TILE_BLOCKS], const uint16_t *x,
                                                            int64_t x_stride, const uint16_t *w, int64_t pairs,
                                                            const int rows, const int blocks) {
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) sum[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512i weight[TILE_BLOCKS];
        for (int b = 0; b < blocks; b++) weight[b] = _mm512_loadu_si512(w + (b * pairs + p) * 32);
        for (int r = 0; r < rows; r++) {
            __m512i both = _mm512_set1_epi32(*(const int32_t *)(x + r * x_stride + 2 * p));
            for (int b = 0; b < blocks; b++) sum[r][b] = _mm512_dpbf16_ps(sum[r][b], (__m512bh)both, (__m512bh)weight[b]);
        }
    }
}

/* Calls TILE(R, B), the caller's tile function unrolled for R rows and B blocks, for rows in
 * 1 ... TILE_ROWS and blocks in 1 ... TILE_BLOCKS. */
#define DISPATCH_TILE(rows, blocks)                                                                         \
    do {                                                                                                    \
        switch ((rows) * 8 + (blocks)) {                                                                    \
            case 9: TILE(1, 1); break; case 10: TILE(1, 2); break; case 11: TILE(1, 3); break; case 12: TILE(1, 4); break; \
            case 17: TILE(2, 1); break; case 18: TILE(2, 2); break; case 19: TILE(2, 3); break; case 20: TILE(2, 4); break; \
            case 25: TILE(3, 1); break; case 26: TILE(3, 2); break; case 27: TILE(3, 3); break; case 28: TILE(3, 4); break; \
            case 33: TILE(4, 1); break; case 34: TILE(4, 2); break; case 35: TILE(4, 3); break; case 36: TILE(4, 4); break; \
            case 41: TILE(5, 1); break; case 42: TILE(5, 2); break; case 43: TILE(5, 3); break; case 44: TILE(5, 4); break; \
            case 49: TILE(6, 1); break; case 50: TILE(6, 2); break; case 51: TILE(6, 3); break; case 52: TILE(6, 4); break; \
        }                                                                                                   \
    } while (0)

#endif
