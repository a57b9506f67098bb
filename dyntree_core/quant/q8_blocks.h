/* What the AVX2 kernels (ggml_kernels.c) and the AVX-512 VNNI kernels (ggml_vnni.c) share: reading a block's fp16
 * scales and Q4_K's packed six-bit scales and mins, and Q4_K's float work after a block's integer sums. One home,
 * so the two paths unpack the same numbers and round alike (their outputs are bit-identical). */
#ifndef DYNTREE_Q8_BLOCKS_H
#define DYNTREE_Q8_BLOCKS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "avx2_sum.h"

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* [d, dmin, 0, 0]: a Q4_K block's two fp16 scales at p */
static inline __m128 f16x2(const uint8_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)u));
}

/* the 8 six-bit scales and mins of a Q4_K block (12 bytes at sc12) as 16 int16: scales 0..7, then mins 0..7.
 * Bytes 0..3 hold scales 0..3 in their low 6 bits and the top 2 bits of scales 4..7 above; bytes 4..7 the same
 * for mins; bytes 8..11 the low 4 bits of scales 4..7 (low nibble) and mins 4..7 (high nibble). One byte
 * shuffle gathers every value's low bits, a second its top two bits. Reads 16 bytes (the quants follow). */
static inline __m256i q4k_scales_mins(const uint8_t *sc12) {
    const __m128i v = _mm_loadu_si128((const __m128i *)sc12);
    const __m128i lo = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i hi = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low = _mm_or_si128(
        _mm_and_si128(lo, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
        _mm_and_si128(_mm_srli_epi16(lo, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_set1_epi8(0x30)); /* (byte >> 6) << 4 */
    return _mm256_cvtepu8_epi16(_mm_or_si128(low, top));
}

/* Q4_K, one block and one activation row, after the integer sums: acc holds 8 int32 lanes of sum_j sc_j * sum(q x)_j
 * over the block's sub-blocks j, dd = [d, dmin], mins the block's 8 mins (int16), dx the row's activation scale and
 * b32 its 8 sums of int8 activations per 32. tot += acc * d*dx; mins_acc += (mins . b32) * dmin*dx. */
static inline __attribute__((always_inline)) void q4k_block_floats(__m256i acc, __m128 dd, __m128i mins, float dx,
                                                                   const int16_t *b32, __m256 *tot, __m128 *mins_acc) {
    const __m128 ddx = _mm_mul_ps(dd, _mm_set1_ps(dx)); /* [d*dx, dmin*dx] */
    const __m128i pm = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)b32));
    *mins_acc = _mm_fmadd_ps(_mm_permute_ps(ddx, 0x55), _mm_cvtepi32_ps(pm), *mins_acc);
    *tot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_broadcastss_ps(ddx), *tot);
}

/* Q4_K, one activation row: its output from the accumulators of q4k_block_floats */
static inline float q4k_row_total(__m256 tot, __m128 mins_acc) {
    __m128 m = _mm_add_ps(mins_acc, _mm_movehl_ps(mins_acc, mins_acc));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return hsum(tot) - _mm_cvtss_f32(m);
}

#endif
