/* Self-attention of a decoder step's tokens over their sequences' keys and values, read where
 * they live in the paged KV pool: bf16, on CPUs with AVX512-BF16. Built and loaded by
 * asrserve/model/cpu_self_attention.py, which says why it exists.
 *
 * Layout (attention.py): one layer's keys (and values) are [num_blocks][block_size][heads][dim],
 * token-major; sequence s's key j is at block block_tables[s][j / block_size], offset
 * j % block_size. q and out are the step's flat rows [token][head][dim]; token t belongs to
 * sequence token_seqs[t] and sees its first token_keys[t] keys (causal: its position + 1).
 *
 * One task is (token, head): its keys are read once for the scores and its values once for the
 * sum; scores, softmax and sums are float32, the output rounded to bf16 once. A task's result
 * depends only on its own inputs, never on the other tokens or sequences in the call (batch
 * invariance).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

#define MAX_HEAD_DIM 256

static inline __attribute__((always_inline)) void attend(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                                         uint16_t *out, float *scores, const int64_t *table,
                                                         int64_t num_keys, int64_t block_size, int64_t heads,
                                                         int64_t head_dim, float scale) {
    /* q, out: this task's row at (token, head); k, v: the layer's pool, already offset to the head. */
    const int64_t chunks32 = (head_dim + 31) / 32, chunks16 = (head_dim + 15) / 16;
    const int64_t token_stride = heads * head_dim;
    __m512i query[MAX_HEAD_DIM / 32];
    for (int64_t c = 0; c < chunks32; c++) query[c] = _mm512_maskz_loadu_epi16(mask32(head_dim - 32 * c), q + 32 * c);
    for (int64_t j = 0; j < num_keys; j++) {
        const uint16_t *key = k + (table[j / block_size] * block_size + j % block_size) * token_stride;
        __m512 dot = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks32; c++)
            dot = _mm512_dpbf16_ps(dot, (__m512bh)query[c], (__m512bh)_mm512_maskz_loadu_epi16(mask32(head_dim - 32 * c), key + 32 * c));
        scores[j] = _mm512_reduce_add_ps(dot) * scale;
    }
    const float norm = softmax_weights(scores, num_keys);
    __m512 acc[MAX_HEAD_DIM / 16];
    for (int64_t c = 0; c < chunks16; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < num_keys; j++) {
        const uint16_t *value = v + (table[j / block_size] * block_size + j % block_size) * token_stride;
        __m512 weight = _mm512_set1_ps(scores[j]);
        for (int64_t c = 0; c < chunks16; c++)
            acc[c] = _mm512_fmadd_ps(weight, load_bf16x16(value + 16 * c, mask16(head_dim - 16 * c)), acc[c]);
    }
    __m512 normalise = _mm512_set1_ps(norm);
    for (int64_t c = 0; c < chunks16; c++) {
        __m256i packed = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[c], normalise));
        _mm256_mask_storeu_epi16(out + 16 * c, mask16(head_dim - 16 * c), packed);
    }
}

/* block_tables: [num_seqs][max_blocks]; token_seqs, token_keys: [num_tokens]; num_blocks: the
 * pool's. threads: torch's intra-op thread count. Returns 0, or 1 when head_dim, a token's key
 * count, sequence or a block it reads is out of range, or working memory could not be had. */
int asrserve_self_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                 const int64_t *block_tables, const int64_t *token_seqs, const int64_t *token_keys,
                                 int64_t num_tokens, int64_t heads, int64_t head_dim, int64_t block_size,
                                 int64_t num_seqs, int64_t max_blocks, int64_t num_blocks, int threads) {
    const int64_t max_keys = max_blocks * block_size;
    if (head_dim <= 0 || head_dim > MAX_HEAD_DIM || block_size <= 0) return 1;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (token_seqs[t] < 0 || token_seqs[t] >= num_seqs || token_keys[t] <= 0 || token_keys[t] > max_keys) return 1;
        const int64_t *table = block_tables + token_seqs[t] * max_blocks;
        for (int64_t b = 0; b <= (token_keys[t] - 1) / block_size; b++)
            if (table[b] < 0 || table[b] >= num_blocks) return 1;
    }
    const float scale = 1.0f / sqrtf((float)head_dim);
    const int64_t tasks = num_tokens * heads;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * max_keys);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == NULL) continue;
            const int64_t token = task / heads, head = task % heads;
            const int64_t row = (token * heads + head) * head_dim;
            const int64_t *table = block_tables + token_seqs[token] * max_blocks;
            if (head_dim == 64)
                attend(q + row, k + head * 64, v + head * 64, out + row, scores, table, token_keys[token], block_size,
                       heads, 64, scale);
            else
                attend(q + row, k + head * head_dim, v + head * head_dim, out + row, scores, table, token_keys[token],
                       block_size, heads, head_dim, scale);
        }
        free(scores);
    }
    return failed;
}
