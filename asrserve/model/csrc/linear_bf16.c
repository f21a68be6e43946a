/* y = x W^T + b for a decoder step's few rows: bf16 in and out, float32 sums, on CPUs with
 * AVX512-BF16. Built and loaded by asrserve/model/cpu_linear.py, which says why it exists.
 *
 * W is packed once (cpu_linear.pack) in pairs of inputs for each of 16 outputs:
 * w[block][pair][output][2], block = output / 16, pair = input / 2, so that one 64-byte load
 * holds two inputs' weights for 16 outputs and one VDPBF16PS adds both products to 16 sums.
 * A tile is up to MAX_ROWS rows by up to MAX_BLOCKS blocks of 16 outputs; its sums stay in
 * registers while the weights stream past once.
 *
 * Each output's sum is its row's products added pair after pair in input order, in one lane,
 * whatever the tile it falls in: a row's result does not depend on the row count or on the
 * other rows (batch invariance).
 */
#include <immintrin.h>
#include <stdint.h>

#define MAX_ROWS 6
#define MAX_BLOCKS 4

static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t in_features, const uint16_t *w,
                                                       int64_t pairs, const float *bias, uint16_t *out,
                                                       int64_t out_features, const int rows, const int blocks) {
    /* x: the tile's first row; w: its first block; out: its first row and output. */
    __m512 sum[MAX_ROWS][MAX_BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) sum[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512i weight[MAX_BLOCKS];
        for (int b = 0; b < blocks; b++) weight[b] = _mm512_loadu_si512(w + (b * pairs + p) * 32);
        for (int r = 0; r < rows; r++) {
            __m512i both = _mm512_set1_epi32(*(const int32_t *)(x + r * in_features + 2 * p));
            for (int b = 0; b < blocks; b++) sum[r][b] = _mm512_dpbf16_ps(sum[r][b], (__m512bh)both, (__m512bh)weight[b]);
        }
    }
    for (int b = 0; b < blocks; b++) {
        __m512 add = bias ? _mm512_loadu_ps(bias + 16 * b) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m256i packed = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum[r][b], add));
            _mm256_storeu_si256((__m256i *)(out + r * out_features + 16 * b), packed);
        }
    }
}

/* One tile of any shape up to MAX_ROWS x MAX_BLOCKS, each shape with its loops unrolled. */
static void any_tile(const uint16_t *x, int64_t in_features, const uint16_t *w, int64_t pairs, const float *bias,
                     uint16_t *out, int64_t out_features, int rows, int blocks) {
#define TILE(R, B) tile(x, in_features, w, pairs, bias, out, out_features, R, B)
#define ROWS(R)                                                                                              \
    case R:                                                                                                  \
        if (blocks == 4) TILE(R, 4); else if (blocks == 3) TILE(R, 3); else if (blocks == 2) TILE(R, 2); else TILE(R, 1); \
        return;
    switch (rows) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) }
#undef ROWS
#undef TILE
}

/* x [rows][in_features], out [rows][out_features] bf16; w packed as above; bias float32
 * [out_features] or NULL. threads: torch's intra-op thread count. Returns 0, or 1 when the
 * shapes are not ones it takes (in_features even, out_features a multiple of 16). */
int asrserve_linear_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out, int64_t rows,
                         int64_t in_features, int64_t out_features, int threads) {
    if (rows < 0 || in_features <= 0 || in_features % 2 || out_features <= 0 || out_features % 16) return 1;
    const int64_t pairs = in_features / 2, num_blocks = out_features / 16;
    const int64_t row_tiles = (rows + MAX_ROWS - 1) / MAX_ROWS;
    const int64_t block_tiles = (num_blocks + MAX_BLOCKS - 1) / MAX_BLOCKS;
    /* Tiles of the same outputs are neighbours in task order, so a thread's static share reads
     * each of its weights once from memory and again from cache for its other rows. */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < block_tiles * row_tiles; task++) {
        const int64_t block = task / row_tiles * MAX_BLOCKS, row = task % row_tiles * MAX_ROWS;
        const int tile_rows = rows - row < MAX_ROWS ? (int)(rows - row) : MAX_ROWS;
        const int tile_blocks = num_blocks - block < MAX_BLOCKS ? (int)(num_blocks - block) : MAX_BLOCKS;
        any_tile(x + row * in_features, in_features, w + block * pairs * 32, pairs, bias ? bias + 16 * block : NULL,
                 out + row * out_features + 16 * block, out_features, tile_rows, tile_blocks);
    }
    return 0;
}
