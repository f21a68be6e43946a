/* Cross-attention of decoding rows over their requests' encoder keys and values, read where
 * they live in the KV pool: bf16, on CPUs with AVX512-BF16. Built and loaded by
 * asrserve/model/cpu_cross_attention.py, which says why it exists.
 *
 * Layout (attention.py): a run of num_slots neighbouring cross slots holds, per slot and head,
 * slot_tokens positions of head_dim values, head-major: k[slot][head][position][dim]; the first
 * cross_len positions are the encoder's. q and out are [slot][row][head][dim]: the rows of a
 * slot are the sequences decoding over it (a request and its fallback samples).
 *
 * One task is (slot, head, up to ROWS_PER_PASS rows): its keys and values are read once, in
 * order, for all its rows; scores, softmax and sums are float32. A task's result depends only
 * on its own inputs, never on how many slots or rows share the call (batch invariance).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

#define ROWS_PER_PASS 16
#define MAX_HEAD_DIM 256

/* Inlined into each call site below, so that a constant head_dim (64: every Whisper size) and a
 * single row unroll its loops and keep the sums in registers. */
static inline __attribute__((always_inline)) void attend(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, float *scores,
                   int64_t rows, int64_t heads, int64_t cross_len, int64_t head_dim, int64_t q_row_stride) {
    /* q, out: this task's first row at (slot, row, head); rows are q_row_stride apart. */
    const int64_t chunks32 = (head_dim + 31) / 32, chunks16 = (head_dim + 15) / 16;
    __m512i query[ROWS_PER_PASS][MAX_HEAD_DIM / 32];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < chunks32; c++)
            query[r][c] = _mm512_maskz_loadu_epi16(mask32(head_dim - 32 * c), q + r * q_row_stride + 32 * c);
    for (int64_t t = 0; t < cross_len; t++) {
        __m512i key[MAX_HEAD_DIM / 32];
        for (int64_t c = 0; c < chunks32; c++)
            key[c] = _mm512_maskz_loadu_epi16(mask32(head_dim - 32 * c), k + t * head_dim + 32 * c);
        for (int64_t r = 0; r < rows; r++) {
            __m512 dot = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks32; c++)
                dot = _mm512_dpbf16_ps(dot, (__m512bh)query[r][c], (__m512bh)key[c]);
            scores[r * cross_len + t] = _mm512_reduce_add_ps(dot);
        }
    }
    float norm[ROWS_PER_PASS];
    for (int64_t r = 0; r < rows; r++) norm[r] = softmax_weights(scores + r * cross_len, cross_len);
    __m512 acc[ROWS_PER_PASS][MAX_HEAD_DIM / 16];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < chunks16; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < cross_len; t++) {
        __m512 value[MAX_HEAD_DIM / 16];
        for (int64_t c = 0; c < chunks16; c++)
            value[c] = load_bf16x16(v + t * head_dim + 16 * c, mask16(head_dim - 16 * c));
        for (int64_t r = 0; r < rows; r++) {
            __m512 weight = _mm512_set1_ps(scores[r * cross_len + t]);
            for (int64_t c = 0; c < chunks16; c++) acc[r][c] = _mm512_fmadd_ps(weight, value[c], acc[r][c]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        __m512 scale = _mm512_set1_ps(norm[r]);
        for (int64_t c = 0; c < chunks16; c++) {
            __m256i packed = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], scale));
            _mm256_mask_storeu_epi16(out + r * q_row_stride + 16 * c, mask16(head_dim - 16 * c), packed);
        }
    }
}

/* threads: torch's intra-op thread count. Returns 0, or 1 when head_dim is out of range or working
 * memory could not be had. */
int asrserve_cross_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                  int64_t num_slots, int64_t rows, int64_t heads, int64_t slot_tokens,
                                  int64_t cross_len, int64_t head_dim, int threads) {
    if (head_dim <= 0 || head_dim > MAX_HEAD_DIM || cross_len <= 0 || cross_len > slot_tokens) return 1;
    const int64_t passes = (rows + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
    const int64_t tasks = num_slots * heads * passes;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * ROWS_PER_PASS * cross_len);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (scores == NULL) continue;
            const int64_t slot = task / (heads * passes), head = task / passes % heads, pass = task % passes;
            const int64_t first_row = pass * ROWS_PER_PASS;
            const int64_t pass_rows = rows - first_row < ROWS_PER_PASS ? rows - first_row : ROWS_PER_PASS;
            const int64_t kv_offset = (slot * heads + head) * slot_tokens * head_dim;
            const int64_t q_offset = ((slot * rows + first_row) * heads + head) * head_dim;
            const uint16_t *task_q = q + q_offset, *task_k = k + kv_offset, *task_v = v + kv_offset;
            uint16_t *task_out = out + q_offset;
            if (head_dim == 64 && pass_rows == 1)
                attend(task_q, task_k, task_v, task_out, scores, 1, heads, cross_len, 64, heads * 64);
            else if (head_dim == 64)
                attend(task_q, task_k, task_v, task_out, scores, pass_rows, heads, cross_len, 64, heads * 64);
            else
                attend(task_q, task_k, task_v, task_out, scores, pass_rows, heads, cross_len, head_dim, heads * head_dim);
        }
        free(scores);
    }
    return failed;
}
