/* The last part of a decode step's sampler, for float32 logits [rows, vocab] after Whisper's
 * rules (asrserve/worker/sampler.py): each row's log-normaliser (logsumexp), its token (the
 * first maximum at temperature 0; else drawn from softmax(logits / temperature) with the row's
 * uniform number, by inverse CDF: the first token whose running sum of e^((x - max) / T)
 * exceeds uniform * total) and that token's log-probability at temperature 1. Built and
 * loaded by asrserve/model/cpu_kernels.py; see asrserve/worker/cpu_sampling.py for why.
 *
 * Rows are independent and computed alike whatever their number (batch invariance). A masked
 * token (-inf) weighs exactly 0 and is never drawn.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vector_math.h"

/* Logits t .. t+15 of a row of `vocab` (past its end: -inf, which weighs 0). */
static inline __m512 load_logits(const float *x, int64_t t, int64_t vocab) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask16(vocab - t), x + t);
}

/* e^((x - top) * scale) of logits t .. t+15. */
static inline __m512 weights_of(const float *x, int64_t t, int64_t vocab, __m512 top, __m512 scale) {
    return exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(load_logits(x, t, vocab), top), scale));
}

/* The index of the last of the 16 weights (of tokens t .. t+15) above 0, or -1. */
static inline int64_t last_with_weight(__m512 weights, int64_t t) {
    __mmask16 positive = _mm512_cmp_ps_mask(weights, _mm512_setzero_ps(), _CMP_GT_OQ);
    return positive ? t + 31 - __builtin_clz((unsigned)positive) : -1;
}

static void sample_row(const float *x, int64_t vocab, float temperature, float uniform, int64_t *token,
                       float *logprob) {
    /* The maximum and its first index: lanes keep their first maximum (strict >), then the
     * lowest index among the lanes holding the overall maximum. */
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_index = _mm512_set1_epi32(0);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (int64_t t = 0; t < vocab; t += 16) {
        __m512 v = load_logits(x, t, vocab);
        __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, greater, v);
        best_index = _mm512_mask_mov_epi32(best_index, greater, index);
        index = _mm512_add_epi32(index, step);
    }
    const float top = _mm512_reduce_max_ps(best);
    __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    int64_t chosen = _mm512_mask_reduce_min_epi32(at_top, best_index);
    if (top == -INFINITY) { /* every token masked: nothing to draw from */
        *token = 0;
        *logprob = -INFINITY;
        return;
    }
    const __m512 top_v = _mm512_set1_ps(top), one = _mm512_set1_ps(1.0f);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < vocab; t += 16) sum = _mm512_add_ps(sum, weights_of(x, t, vocab, top_v, one));
    const float log_normaliser = top + logf(_mm512_reduce_add_ps(sum));
    if (temperature > 0) {
        /* The running sum and the total add the same 16-token block sums in the same order, in
         * double (as torch's float cumsum accumulates), so the draw lands where a float64
         * cumulative sum puts it up to the rounding of the weights themselves. */
        const __m512 inverse_t = _mm512_set1_ps(1.0f / temperature);
        double total = 0.0;
        for (int64_t t = 0; t < vocab; t += 16) total += _mm512_reduce_add_ps(weights_of(x, t, vocab, top_v, inverse_t));
        const double target = (double)uniform * total;
        double running = 0.0;
        int64_t found = -1;
        for (int64_t t = 0; t < vocab && found < 0; t += 16) {
            const __m512 w = weights_of(x, t, vocab, top_v, inverse_t);
            const float block = _mm512_reduce_add_ps(w);
            if (running + block <= target) { /* not in this block */
                running += block;
                continue;
            }
            float weights[16];
            _mm512_storeu_ps(weights, w);
            double within = running;
            for (int j = 0; j < 16 && found < 0; j++) {
                within += weights[j];
                if (within > target && weights[j] > 0) found = t + j;
            }
            if (found < 0) found = last_with_weight(w, t); /* the block holds the point; its sum rounded otherwise */
        }
        /* A draw at the very top can round to the total: the last token with weight. */
        for (int64_t t = (vocab - 1) / 16 * 16; found < 0 && t >= 0; t -= 16)
            found = last_with_weight(weights_of(x, t, vocab, top_v, inverse_t), t);
        chosen = found;
    }
    *token = chosen;
    *logprob = x[chosen] - log_normaliser;
}

/* temperatures[r] == 0: greedy. threads: torch's intra-op thread count. Returns 0. */
int asrserve_sample_rows(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride,
                         const float *temperatures, const float *uniforms, int64_t *tokens, float *logprobs,
                         int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++)
        sample_row(logits + r * row_stride, vocab, temperatures[r], uniforms[r], tokens + r, logprobs + r);
    return 0;
}
