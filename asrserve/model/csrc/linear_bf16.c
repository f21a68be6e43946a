/* y = x W^T + b, then GELU or plus a residual, for a decoder step's few rows and the encoder's
 * 1500: bf16 in and out, float32 sums, on CPUs with AVX512-BF16. Built and loaded by
 * asrserve/model/cpu_linear.py, which says why it exists.
 *
 * W is packed once (cpu_linear.pack) as bf16_tiles.h reads it. A row's result does not depend
 * on the row count or on the other rows (batch invariance): see bf16_tiles.h. The epilogue
 * works on the float32 sums before the one rounding to bf16.
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16_tiles.h"
#include "linear_epilogue.h"

static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t in_features, const uint16_t *w,
                                                       int64_t pairs, const float *bias, int epilogue,
                                                       const uint16_t *residual, uint16_t *out,
                                                       int64_t out_features, const int rows, const int blocks) {
    /* x: the tile's first row; w: its first block; residual, out: their first row and output. */
    __m512 sum[TILE_ROWS][TILE_BLOCKS];
    tile_sums(sum, x, in_features, w, pairs, rows, blocks);
    store_tile(sum, bias, epilogue, residual, out, out_features, rows, blocks);
}

/* x [rows][in_features], out and residual [rows][out_features] bf16; w packed as above; bias
 * float32 [out_features] or NULL; epilogue one of EPILOGUE_* (residual read only for
 * EPILOGUE_RESIDUAL). threads: torch's intra-op thread count. Returns 0, or 1 when the shapes
 * are not ones it takes (in_features even, out_features a multiple of 16) or the epilogue is
 * unknown or lacks its residual. */
int asrserve_linear_bf16(const uint16_t *x, const uint16_t *w, const float *bias, int epilogue,
                         const uint16_t *residual, uint16_t *out, int64_t rows, int64_t in_features,
                         int64_t out_features, int threads) {
    if (rows < 0 || in_features <= 0 || in_features % 2 || out_features <= 0 || out_features % 16) return 1;
    if (epilogue < EPILOGUE_NONE || epilogue > EPILOGUE_RESIDUAL || (epilogue == EPILOGUE_RESIDUAL && !residual))
        return 1;
    const int64_t pairs = in_features / 2, num_blocks = out_features / 16;
    const int64_t row_tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t block_tiles = (num_blocks + TILE_BLOCKS - 1) / TILE_BLOCKS;
    /* Tiles of the same outputs are neighbours in task order, so a thread's static share reads
     * each of its weights once from memory and again from cache for its other rows. */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < block_tiles * row_tiles; task++) {
        const int64_t block = task / row_tiles * TILE_BLOCKS, row = task % row_tiles * TILE_ROWS;
        const int tile_rows = rows - row < TILE_ROWS ? (int)(rows - row) : TILE_ROWS;
        const int tile_blocks = num_blocks - block < TILE_BLOCKS ? (int)(num_blocks - block) : TILE_BLOCKS;
        const uint16_t *x_tile = x + row * in_features, *w_tile = w + block * pairs * 32;
        const float *bias_tile = bias ? bias + 16 * block : NULL;
        uint16_t *out_tile = out + row * out_features + 16 * block;
        const uint16_t *residual_tile = residual ? residual + row * out_features + 16 * block : NULL;
        /* The epilogue is a constant in each expansion, so the common one costs no test. */
        if (epilogue == EPILOGUE_NONE) {
#define TILE(R, B) tile(x_tile, in_features, w_tile, pairs, bias_tile, EPILOGUE_NONE, NULL, out_tile, out_features, R, B)
            DISPATCH_TILE(tile_rows, tile_blocks);
#undef TILE
        } else if (epilogue == EPILOGUE_GELU) {
#define TILE(R, B) tile(x_tile, in_features, w_tile, pairs, bias_tile, EPILOGUE_GELU, NULL, out_tile, out_features, R, B)
            DISPATCH_TILE(tile_rows, tile_blocks);
#undef TILE
        } else {
#define TILE(R, B) tile(x_tile, in_features, w_tile, pairs, bias_tile, EPILOGUE_RESIDUAL, residual_tile, out_tile, out_features, R, B)
            DISPATCH_TILE(tile_rows, tile_blocks);
#undef TILE
        }
    }
    return 0;
}
