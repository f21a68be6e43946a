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

/* r[i] = the sum of d[i]'s 16 lanes for i < 16, added in exactly the order GCC's
 * _mm512_reduce_add_ps adds them (lane j + lane j + 8, then + 4, + 2, + 1: float addition
 * commutes, so its bits), but four additions for sixteen sums instead of four for each. The
 * sums come out transposed (lane 4 j + i holds d[4 i + j]'s), so callers pass d in that order:
 * d[4 i + j] for the sum they want in lane 4 j + i. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 d[16]) {
    __m512 halves[8], quarters[4], eighths[2];
    for (int m = 0; m < 8; m++)  /* per vector: lanes j and j + 8 */
        halves[m] = _mm512_add_ps(_mm512_shuffle_f32x4(d[2 * m], d[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(d[2 * m], d[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int p = 0; p < 4; p++)  /* then k and k + 4 */
        quarters[p] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * p], halves[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(halves[2 * p], halves[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int q = 0; q < 2; q++)  /* then 0 + 2 and 1 + 3 */
        eighths[q] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * q], quarters[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(quarters[2 * q], quarters[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* out rows 0 ... R - 1 (q_row_stride apart) = their weights (scores, cross_len apart) times
 * the values, times norm: for head_dim 64 and R a constant, so that the R x 4 sums stay in
 * registers (a loop over a variable number of rows keeps them in memory, a load and a store
 * around every multiply-add). Each sum adds the same products in the same order as the loop
 * in attend. */
static inline __attribute__((always_inline)) void weighted_values_64(const float *scores, int64_t cross_len,
                                                                     const uint16_t *v, const float *norm,
                                                                     uint16_t *out, int64_t q_row_stride, const int R) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < cross_len; t++) {
        __m512 value[4];
        for (int c = 0; c < 4; c++) value[c] = load_bf16x16(v + t * 64 + 16 * c, 0xFFFF);
        for (int r = 0; r < R; r++) {
            const __m512 weight = _mm512_set1_ps(scores[r * cross_len + t]);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(weight, value[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++)
            _mm256_storeu_si256((__m256i *)(out + r * q_row_stride + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], _mm512_set1_ps(norm[r]))));
}

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
    /* Sixteen keys at a time: each row's sixteen dot products, summed across lanes together
     * (reduce16, the same bits as one at a time below). */
    const int64_t grouped = rows > 1 ? cross_len / 16 * 16 : 0;
    for (int64_t t = 0; t < grouped; t += 16) {
        for (int64_t r = 0; r < rows; r++) {
            __m512 dots[16];
            for (int n = 0; n < 16; n++) {
                const uint16_t *key = k + (t + n % 4 * 4 + n / 4) * head_dim;  /* transposed: see reduce16 */
                __m512 dot = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks32; c++)
                    dot = _mm512_dpbf16_ps(dot, (__m512bh)query[r][c],
                                           (__m512bh)_mm512_maskz_loadu_epi16(mask32(head_dim - 32 * c), key + 32 * c));
                dots[n] = dot;
            }
            _mm512_storeu_ps(scores + r * cross_len + t, reduce16(dots));
        }
    }
    for (int64_t t = grouped; t < cross_len; t++) {
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
    if (head_dim == 64 && rows > 1) {  /* four rows at a time, their sums in registers */
        for (int64_t r = 0; r < rows; r += 4) {
            const float *s = scores + r * cross_len;
            uint16_t *o = out + r * q_row_stride;
            switch (rows - r < 4 ? rows - r : 4) {
                case 1: weighted_values_64(s, cross_len, v, norm + r, o, q_row_stride, 1); break;
                case 2: weighted_values_64(s, cross_len, v, norm + r, o, q_row_stride, 2); break;
                case 3: weighted_values_64(s, cross_len, v, norm + r, o, q_row_stride, 3); break;
                default: weighted_values_64(s, cross_len, v, norm + r, o, q_row_stride, 4); break;
            }
        }
        return;
    }
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
