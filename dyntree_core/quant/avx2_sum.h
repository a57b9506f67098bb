/* The horizontal sum of 8 floats, shared by ggml_kernels.c and decoder_layer.c (lanes added pairwise:
 * (0+4, 1+5, 2+6, 3+7), then those pairs, then the last two). */
#ifndef DYNTREE_AVX2_SUM_H
#define DYNTREE_AVX2_SUM_H
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
