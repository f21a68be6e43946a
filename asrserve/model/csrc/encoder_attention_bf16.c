/* The encoder's self-attention (every position over every position, no mask) in bf16, on CPUs
 * with AVX512-BF16. Built and loaded by asrserve/model/cpu_encoder_attention.py, which says why
 * it exists.
 *
 * qkv is the QKV projection's output [batch][length][3][heads][dim]; out is [batch][length]
 * [heads][dim]. Per (audio, head), keys are packed as the right-hand matrix of the scores'
 * product and values, transposed, as that of the output's (bf16_tiles.h's layout: positions
 * padded with zeros to a multiple of 16). Then per tile of TILE_ROWS queries: their scores
 * against every key in float32 (in cache: 6 rows x 1504), the softmax's exponentials in
 * float32 rounded to bf16 as weights, their product with the values in float32 divided by the
 * exponentials' float32 sum, and the output rounded to bf16 once.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "vector_math.h"

static inline __attribute__((always_inline)) void score_tile(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                                                             int64_t pairs, float *scores, int64_t scores_stride,
                                                             float scale, const int rows, const int blocks) {
    __m512 sum[TILE_ROWS][TILE_BLOCKS];
    tile_sums(sum, q, q_stride, k, pairs, rows, blocks);
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++)
            _mm512_storeu_ps(scores + r * scores_stride + 16 * b, _mm512_mul_ps(sum[r][b], _mm512_set1_ps(scale)));
}

static inline __attribute__((always_inline)) void output_tile(const uint16_t *weights, int64_t weights_stride,
                                                              const float *norms, const uint16_t *v, int64_t pairs,
                                                              uint16_t *out, int64_t out_stride, const int rows,
                                                              const int blocks) {
    __m512 sum[TILE_ROWS][TILE_BLOCKS];
    tile_sums(sum, weights, weights_stride, v, pairs, rows, blocks);
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) {
            __m512 normalised = _mm512_mul_ps(sum[r][b], _mm512_set1_ps(norms[r]));
            _mm256_storeu_si256((__m256i *)(out + r * out_stride + 16 * b), (__m256i)_mm512_cvtneps_pbh(normalised));
        }
}

/* One row's scores -> its unnormalised weights e^(s - max), rounded to bf16, in one pass;
 * returns 1 / their float32 sum, which the output tile applies. */
static float row_weights(const float *scores, uint16_t *weights, int64_t length) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < length; t += 16)
        best = _mm512_max_ps(best, _mm512_mask_loadu_ps(best, mask16(length - t), scores + t));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 16) {
        const __mmask16 m = mask16(length - t);
        const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), top)));
        total = _mm512_add_ps(total, e);
        _mm256_mask_storeu_epi16(weights + t, m, (__m256i)_mm512_cvtneps_pbh(e));
    }
    return 1.0f / _mm512_reduce_add_ps(total);
}

/* Keys as w[position block][dim pair][16 positions][2] and values as w[dim block][position
 * pair][16 dims][2], zero past length. */
static void pack_head(const uint16_t *qkv, int64_t length, int64_t padded, int64_t heads, int64_t head_dim,
                      uint16_t *k_packed, uint16_t *v_packed) {
    const int64_t row = 3 * heads * head_dim, dim_pairs = head_dim / 2, position_pairs = padded / 2;
    const uint16_t *k = qkv + heads * head_dim, *v = qkv + 2 * heads * head_dim;
    for (int64_t t = 0; t < padded; t++)
        for (int64_t d = 0; d < head_dim; d++) {
            const uint16_t key = t < length ? k[t * row + d] : 0, value = t < length ? v[t * row + d] : 0;
            k_packed[((t / 16 * dim_pairs + d / 2) * 16 + t % 16) * 2 + d % 2] = key;
            v_packed[((d / 16 * position_pairs + t / 2) * 16 + d % 16) * 2 + t % 2] = value;
        }
}

/* threads: torch's intra-op thread count. Returns 0, or 1 when head_dim is not a multiple of 16
 * or working memory could not be had. */
int asrserve_encoder_attention_bf16(const uint16_t *qkv, uint16_t *out, int64_t batch, int64_t length,
                                    int64_t heads, int64_t head_dim, int threads) {
    if (head_dim <= 0 || head_dim % 16 || length <= 0) return 1;
    const int64_t padded = (length + 15) / 16 * 16, per_head = padded * head_dim;
    const int64_t row = 3 * heads * head_dim, out_row = heads * head_dim;
    const int64_t query_tiles = (length + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t key_blocks = padded / 16, dim_blocks = head_dim / 16;
    const float scale = 1.0f / sqrtf((float)head_dim);
    uint16_t *k_packed = malloc(sizeof(uint16_t) * batch * heads * per_head);
    uint16_t *v_packed = malloc(sizeof(uint16_t) * batch * heads * per_head);
    int failed = k_packed == NULL || v_packed == NULL;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < batch * heads; bh++)
                pack_head(qkv + (bh / heads) * length * row + (bh % heads) * head_dim, length, padded, heads, head_dim,
                          k_packed + bh * per_head, v_packed + bh * per_head);
            float *scores = malloc(sizeof(float) * TILE_ROWS * padded);
            uint16_t *weights = calloc(TILE_ROWS * padded, sizeof(uint16_t));
            if (scores == NULL || weights == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t task = 0; task < batch * heads * query_tiles; task++) {
                if (scores == NULL || weights == NULL) continue;
                const int64_t bh = task / query_tiles, first = task % query_tiles * TILE_ROWS;
                const int64_t b = bh / heads, h = bh % heads;
                const int rows = length - first < TILE_ROWS ? (int)(length - first) : TILE_ROWS;
                const uint16_t *q = qkv + (b * length + first) * row + h * head_dim;
                for (int64_t block = 0; block < key_blocks; block += TILE_BLOCKS) {
                    const int blocks = key_blocks - block < TILE_BLOCKS ? (int)(key_blocks - block) : TILE_BLOCKS;
                    const uint16_t *k_tile = k_packed + bh * per_head + block * head_dim * 16;
#define TILE(R, B) score_tile(q, row, k_tile, head_dim / 2, scores + 16 * block, padded, scale, R, B)
                    DISPATCH_TILE(rows, blocks);
#undef TILE
                }
                float norms[TILE_ROWS];
                for (int r = 0; r < rows; r++) norms[r] = row_weights(scores + r * padded, weights + r * padded, length);
                uint16_t *o = out + (b * length + first) * out_row + h * head_dim;
                for (int64_t block = 0; block < dim_blocks; block += TILE_BLOCKS) {
                    const int blocks = dim_blocks - block < TILE_BLOCKS ? (int)(dim_blocks - block) : TILE_BLOCKS;
                    const uint16_t *v_tile = v_packed + bh * per_head + block * padded * 16;
#define TILE(R, B) output_tile(weights, padded, norms, v_tile, padded / 2, o + 16 * block, out_row, R, B)
                    DISPATCH_TILE(rows, blocks);
#undef TILE
                }
            }
            free(scores);
            free(weights);
        }
    }
    free(k_packed);
    free(v_packed);
    return failed;
}
