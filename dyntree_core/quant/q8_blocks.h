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

/* ---- Q4_K x8 (ggml_kernels.c: the layout, the repacking and the arithmetic) ---- */
/* X8_ROWS / X8_VNNI_ROWS: activation rows per AVX2 / VNNI tile. X8_PAIR_MIN_ROWS: from this many rows on the VNNI
 * tiles take two groups per zmm (ggml_vnni.c); below it one group per ymm, since two groups read side by side are
 * two memory streams, which ran at ~2/3 of one stream's bandwidth on a Zen 4 (the Q6_K head at 1 row: 7.9 vs 5.5 ms;
 * weights from DRAM at 1-4 rows; from 5 rows the pairs win: docs/CPU_KERNELS.md) */
enum { Q4K_X8_BYTES = 1184, X8_ROWS = 4, X8_VNNI_ROWS = 8, X8_PAIR_MIN_ROWS = 5, X8_PREFETCH_BLOCKS = 2 };
/* where a Q4_K x8 block's parts start (the layout: ggml_kernels.c, "Q4_K x8"): d and dmin at 0, the scales, the
 * mins' pairs, the nibbles */
enum { Q4K_X8_SC = 32, Q4K_X8_MN = 96, Q4K_X8_QS = 160 };

/* Share `part` of `parts` of the block X8_PREFETCH_BLOCKS ahead of o (of `bytes` bytes) into L1: a group's blocks are
 * one sequential stream, but without this the streamed Q6_K head ran at half the row kernels' bandwidth on a Zen 4
 * (14 vs 29 GB/s; 30 GB/s with it) */
static inline __attribute__((always_inline)) void x8_prefetch(const uint8_t *o, int bytes, int part, int parts) {
    const uint8_t *p = o + X8_PREFETCH_BLOCKS * bytes + part * bytes / parts;
    for (int i = 0; i < bytes / parts; i += 64) _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

static inline __attribute__((always_inline)) __m256i bcast_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Q4_K x8, after block b's integer sums isum[r] (sum_j sc_j * sum(q x)_j per column) of R activation rows: the
 * mins' sums sum_j m_j * sum(x8)_j, then acc[r] = fma(float(isum), d*dx, acc[r]); acc[r] = fma(-float(mins), dmin*dx,
 * acc[r]) with o the block's x8 bytes, dx row r's activation scale and b32 its sums of int8 activations per 32 */
static inline __attribute__((always_inline)) void q4k_x8_block_floats(const int R, const uint8_t *o,
                                                                       const __m256i *isum, int64_t b, const float *d8,
                                                                       const int16_t *b32, int64_t K, __m256 *acc) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16)));
    __m256i m16[4];
    for (int p = 0; p < 4; p++)
        m16[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(o + Q4K_X8_MN + 16 * p)));
    for (int r = 0; r < R; r++) {
        const int16_t *bs = b32 + r * (K / 32) + b * 8;
        __m256i nsum = _mm256_madd_epi16(m16[0], bcast_i32(bs));
        for (int p = 1; p < 4; p++) nsum = _mm256_add_epi32(nsum, _mm256_madd_epi16(m16[p], bcast_i32(bs + 2 * p)));
        const __m256 dx = _mm256_set1_ps(d8[r * (K / 256) + b]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dx), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(nsum), _mm256_mul_ps(dmin, dx), acc[r]);
    }
}

/* ---- Q6_K x8 (ggml_kernels.c) ---- */
enum { Q6K_X8_BYTES = 1680 };

/* ---- Q5_0 x8 (ggml_kernels.c; its tile: q5_0_x8.h) ---- */
enum { Q5_0_X8_BYTES = 176 };

/* sub-block s's 4 groups of 4 values x 8 columns as unsigned bytes (0..63): u[t] holds values 16 s + 4 t .. + 3 */
static inline __attribute__((always_inline)) void q6k_x8_quants(const uint8_t *o, int s, __m256i m4, __m256i m30,
                                                                 __m256i *u) {
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(o + 144 + 64 * s));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(o + 144 + 64 * s + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(o + 144 + 1024 + 32 * s));
    u[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
    u[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
    u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m30));
    u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
}

/* sub-block s's 8 column scales, each twice, as int16 (vpmaddwd's operand) */
static inline __attribute__((always_inline)) __m256i q6k_x8_scales(const uint8_t *o, int s) {
    const __m128i sc = _mm_loadl_epi64((const __m128i *)(o + 16 + 8 * s));
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc, sc));
}

/* isum[r] = -32 * sum_s sc_s * (sum of row r's int8 activations in sub-block s), per column (b16: sums per 16) */
static inline __attribute__((always_inline)) void q6k_x8_offsets(const int R, const uint8_t *o, int64_t b,
                                                                  const int16_t *b16, int64_t K, __m256i *isum) {
    __m256i pairs[8];
    for (int p = 0; p < 8; p++) {
        const __m128i a = _mm_loadl_epi64((const __m128i *)(o + 16 + 16 * p));
        const __m128i c = _mm_loadl_epi64((const __m128i *)(o + 16 + 16 * p + 8));
        pairs[p] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, c)); /* (sc_2p, sc_2p+1) per column */
    }
    for (int r = 0; r < R; r++) {
        const int16_t *bs = b16 + r * (K / 16) + b * 16;
        __m256i t = _mm256_madd_epi16(pairs[0], bcast_i32(bs));
        for (int p = 1; p < 8; p++) t = _mm256_add_epi32(t, _mm256_madd_epi16(pairs[p], bcast_i32(bs + 2 * p)));
        isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(t, 5));
    }
}

/* Q6_K x8, after block b's integer sums isum[r] of R activation rows: acc[r] = fma(float(isum), d*dx, acc[r]) */
static inline __attribute__((always_inline)) void q6k_x8_block_floats(const int R, const uint8_t *o,
                                                                       const __m256i *isum, int64_t b, const float *d8,
                                                                       int64_t K, __m256 *acc) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(d8[r * (K / 256) + b])),
                                 acc[r]);
}

#endif
