/* What the linear kernels (linear_bf16.c, linear_int8.c) do with a tile's float32 sums before
 * their one rounding to bf16: the bias, then GELU or a residual add. */
#ifndef ASRSERVE_LINEAR_EPILOGUE_H
#define ASRSERVE_LINEAR_EPILOGUE_H

#include <immintrin.h>
#include <stdint.h>

#include "bf16_tiles.h"
#include "vector_math.h"

#define EPILOGUE_NONE 0
#define EPILOGUE_GELU 1     /* x * (1 + erf(x / sqrt 2)) / 2, nn.GELU's exact form */
#define EPILOGUE_RESIDUAL 2 /* plus residual[row][output] (bf16) */

/* GELU through erfc by Abramowitz and Stegun 7.1.26 (absolute error under 1.5e-7):
 * erfc(|z|) ~ (a1 t + ... + a5 t^5) e^(-z^2) with t = 1 / (1 + p |z|), and 1 + erf(z) is
 * erfc(|z|) below zero (no cancellation in the negative tail) and 2 - erfc(|z|) above. */
static inline __m512 gelu(__m512 x) {
    const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
    const __m512 a = _mm512_abs_ps(z);
    const __m512 d = _mm512_fmadd_ps(a, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.0f));
    __m512 t = _mm512_rcp14_ps(d); /* 1 / d to 14 bits, then one Newton step: ~1e-8 */
    t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.0f)));
    __m512 poly = _mm512_set1_ps(1.061405429f);
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-1.453152027f));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(1.421413741f));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-0.284496736f));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(0.254829592f));
    poly = _mm512_mul_ps(poly, t);
    const __m512 erfc_abs = _mm512_mul_ps(poly, exp_nonpositive(_mm512_mul_ps(a, _mm512_sub_ps(_mm512_setzero_ps(), a))));
    const __m512 one_plus_erf = _mm512_mask_sub_ps(erfc_abs, _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ),
                                                   _mm512_set1_ps(2.0f), erfc_abs);
    return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), one_plus_erf);
}

/* out[r][16 b ...] = epilogue(sum[r][b] + bias[16 b ...]) rounded to bf16; out and residual
 * point at the tile's first row and output, out_features apart. */
static inline __attribute__((always_inline)) void store_tile(__m512 sum[TILE_ROWS][TILE_BLOCKS], const float *bias,
                                                             int epilogue, const uint16_t *residual, uint16_t *out,
                                                             int64_t out_features, const int rows, const int blocks) {
    if (epilogue == EPILOGUE_GELU) {
        /* The sums go to cache first: GELU's temporaries and constants beside 24 live sums
         * spill registers (the epilogue took 0.7-0.9 ms of a [1500, 1536] product that way,
         * 0.5 ms staged; tiny.en, 2 cores). */
        float staged[TILE_ROWS][TILE_BLOCKS][16];
        for (int b = 0; b < blocks; b++) {
            __m512 add = bias ? _mm512_loadu_ps(bias + 16 * b) : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++) _mm512_storeu_ps(staged[r][b], _mm512_add_ps(sum[r][b], add));
        }
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < blocks; b++)
                _mm256_storeu_si256((__m256i *)(out + r * out_features + 16 * b),
                                    (__m256i)_mm512_cvtneps_pbh(gelu(_mm512_loadu_ps(staged[r][b]))));
        return;
    }
    for (int b = 0; b < blocks; b++) {
        __m512 add = bias ? _mm512_loadu_ps(bias + 16 * b) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m512 y = _mm512_add_ps(sum[r][b], add);
            if (epilogue == EPILOGUE_RESIDUAL)
                y = _mm512_add_ps(y, load_bf16x16(residual + r * out_features + 16 * b, 0xFFFF));
            __m256i packed = (__m256i)_mm512_cvtneps_pbh(y);
            _mm256_storeu_si256((__m256i *)(out + r * out_features + 16 * b), packed);
        }
    }
}

#endif
