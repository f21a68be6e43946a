/* Vector helpers shared by the C kernels (AVX-512). */
#ifndef ASRSERVE_VECTOR_MATH_H
#define ASRSERVE_VECTOR_MATH_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline __mmask32 mask32(int64_t remaining) {
    return remaining >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << remaining) - 1u);
}

static inline __mmask16 mask16(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1u);
}

static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 m) {
    __m256i x = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* e^x for x <= 0 (values less their maximum; -inf gives 0), relative error ~2e-7: x = n ln2 + f with
 * |f| <= ln2/2, e^f by its Taylor polynomial to degree 6, times 2^n. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-120.0f)); /* e^x is 0 in float32 below about -104 */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), f);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Scores -> unnormalised weights e^(s - max) in place; returns 1 / their sum. */
static inline float softmax_weights(float *scores, int64_t length) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < length; t += 16)
        best = _mm512_max_ps(best, _mm512_mask_loadu_ps(best, mask16(length - t), scores + t));
    __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 16) {
        __mmask16 m = mask16(length - t);
        __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), top)));
        _mm512_mask_storeu_ps(scores + t, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

#endif
