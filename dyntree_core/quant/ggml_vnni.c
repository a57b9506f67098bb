/* Q4_K and Q6_K weights against int8 (Q8_K) activations on AVX-512 VNNI: the int8-activation row kernels of
 * ggml_kernels.c with the same integer sums, 64 weights per instruction instead of 32. Further down: the Q5_0 row
 * kernel (Q8_0 activations), and the x8 tiles of Q4_K, Q6_K and Q5_0 (each the AVX2 tile's bits).
 *
 * Per 64 weights and activation row the AVX2 kernels issue 2 loads, 2 vpmaddubsw, 2 vpmaddwd (times the
 * sub-block scales) and 2 vpaddd; here 1 load, 1 vpmaddubsw and 1 vpdpwssd (the scale product and the add in
 * one instruction), on zmm registers whose two 256-bit halves hold what the AVX2 kernel holds in two ymm
 * registers. At the end of each block the 16 int32 lanes fold (low half + high half) into the AVX2 kernel's 8:
 * integer sums of the same products, exact in any order (|sum| < 2^23). From there every float operation is
 * the AVX2 kernel's, in its order, so each output is bit-identical to ggml_kernels.c's for every M
 * (tests/test_ggml_vnni.py), and a tree's accepted path keeps plain decoding's logits whichever path runs.
 *
 * This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni (quant/native.py); its row
 * kernels run only where dyntree_vnni_supported() says the CPU has those. With DYNTREE_VNNI_SIMDE the same code
 * is compiled against SIMDe's portable implementations of the AVX-512 intrinsics (Debian's libsimde-dev), so
 * the bit-identity tests run on any AVX2 machine; that build is for tests only.
 */
#ifdef DYNTREE_VNNI_SIMDE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define madd512 simde_mm512_madd_epi16 /* SIMDe's native alias of _mm512_madd_epi16 takes the masked form's 4 */
#else
#define madd512 _mm512_madd_epi16
#endif
#include <immintrin.h>
#include <stdint.h>

#include "avx2_sum.h"
#include "q8_blocks.h"

#define ROWS_KERNEL static inline __attribute__((always_inline))

/* zmm conversions, lane by lane; SIMDe (0.7.4) has no zmm vcvtph2ps, vpmovzxbw or vcvtdq2ps, so its build converts
 * the two halves with the ymm instructions: the same values */
#ifdef DYNTREE_VNNI_SIMDE
static inline __m512 join_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
static inline __m512 cvtph512(__m256i h) {
    return join_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
static inline __m512i cvtepu8_16_512(__m256i v) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v))),
                              _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), 1);
}
static inline __m512 cvtepi32_ps512(__m512i v) {
    return join_ps(_mm256_cvtepi32_ps(_mm512_castsi512_si256(v)), _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(v, 1)));
}
#else
#define cvtph512 _mm512_cvtph_ps
#define cvtepu8_16_512 _mm512_cvtepu8_epi16
#define cvtepi32_ps512 _mm512_cvtepi32_ps
#endif

int dyntree_vnni_supported(void) {
#ifdef DYNTREE_VNNI_SIMDE
    return 1;
#else
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
}

/* 1 when built against SIMDe (tests), 0 for the real instructions */
int dyntree_vnni_emulated(void) {
#ifdef DYNTREE_VNNI_SIMDE
    return 1;
#else
    return 0;
#endif
}

/* int16 lanes 0..15 = a, 16..31 = b */
static inline __m512i halves16(int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)a)), _mm256_set1_epi16((short)b), 1);
}

/* vpshufb control that fills each 128-bit lane q with int16 lane i[q] of that lane (scales broadcast to all four
 * lanes first): one single-uop shuffle where vpermw takes two */
static inline __m512i pick16(int i0, int i1, int i2, int i3) {
#define PAIR(i) (short)((2 * (i)) | ((2 * (i) + 1) << 8))
    return _mm512_set_epi16(PAIR(i3), PAIR(i3), PAIR(i3), PAIR(i3), PAIR(i3), PAIR(i3), PAIR(i3), PAIR(i3),
                            PAIR(i2), PAIR(i2), PAIR(i2), PAIR(i2), PAIR(i2), PAIR(i2), PAIR(i2), PAIR(i2),
                            PAIR(i1), PAIR(i1), PAIR(i1), PAIR(i1), PAIR(i1), PAIR(i1), PAIR(i1), PAIR(i1),
                            PAIR(i0), PAIR(i0), PAIR(i0), PAIR(i0), PAIR(i0), PAIR(i0), PAIR(i0), PAIR(i0));
#undef PAIR
}

/* Q4_K: chunk j (32 bytes of nibbles) holds sub-block 2j (low nibbles, activations 64j..64j+31) and 2j+1 (high
 * nibbles, 64j+32..64j+63): broadcast to both halves of a zmm, shifted right by 0 and 4 and masked, it is
 * [low | high] and meets the 64 activations in memory order. Scales: sub-block 2j's over the low half, 2j+1's over
 * the high half. (Building that zmm by vinserti64x4 and the scales by vpermw put 3 more uops per chunk on port 5,
 * the one 512-bit shuffle port: llvm-mca, icelake-server, 1 row: 18.0 -> cycles per block, see CPU_KERNELS.md.) */
ROWS_KERNEL void q4k_vnni(const int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                          const int16_t *b32, int64_t K, float *out) {
    __m256 tot[8];
    __m128 mins_acc[8];
    for (int r = 0; r < R; r++) {
        tot[r] = _mm256_setzero_ps();
        mins_acc[r] = _mm_setzero_ps();
    }
    const __m512i mask = _mm512_set1_epi8(0x0F), nib_shift = halves16(0, 4);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wr + b * 144;
        const __m128 dd = f16x2(blk);
        const __m256i sm = q4k_scales_mins(blk + 4);
        const __m128i mins = _mm256_extracti128_si256(sm, 1);
        const __m512i sc4 = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sm)); /* scales 0..7 in every lane */
        __m512i acc[8];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * j));
            const __m512i w = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(bytes), nib_shift), mask);
            const __m512i s = _mm512_shuffle_epi8(sc4, pick16(2 * j, 2 * j, 2 * j + 1, 2 * j + 1));
            for (int r = 0; r < R; r++) {
                const __m512i x = _mm512_loadu_si512((const void *)(q8 + r * K + b * 256 + 64 * j));
                acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maddubs_epi16(w, x), s);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i a = _mm256_add_epi32(_mm512_castsi512_si256(acc[r]), _mm512_extracti64x4_epi64(acc[r], 1));
            q4k_block_floats(a, dd, mins, d8[r * (K / 256) + b], b32 + r * (K / 32) + b * 8, &tot[r], &mins_acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = q4k_row_total(tot[r], mins_acc[r]);
}

/* Q6_K: per 128 values, quant groups g and g+1 (g = 0, 2) are 64 activations in a row; group g's 6-bit quants
 * are ql's low (g < 2) or high nibbles of 32 bytes at 32*(g&1) with qh's bit pair g on top (ggml_kernels.c's
 * q6k_quants), so groups (0, 1) take ql[0..63]'s low nibbles and qh shifted left by 4 and 2, groups (2, 3) the
 * high nibbles and qh shifted by 0 and right by 2. Each 16 values share a scale: four per zmm. */
ROWS_KERNEL void q6k_vnni(const int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                          const int16_t *bs, int64_t K, float *out) {
    __m256 tot[4];
    for (int r = 0; r < R; r++) tot[r] = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl01 = halves16(4, 2), shr23 = halves16(0, 2);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wr + b * 210;
        const float d = f16(blk + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256i m32 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc16, 5)); /* -32 sc */
        __m256i acc[4];
        __m512i acc2[4];
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_madd_epi16(m32, _mm256_loadu_si256((const __m256i *)(bs + r * (K / 16) + b * 16)));
            acc2[r] = _mm512_setzero_si512();
        }
        for (int half = 0; half < 2; half++) {
            /* this half's 8 scales in every 128-bit lane */
            const __m512i sc4 = _mm512_broadcast_i32x4(half ? _mm256_extracti128_si256(sc16, 1)
                                                            : _mm256_castsi256_si128(sc16));
            const __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * half));
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half)));
            const __m512i u[2] = {
                _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi16(h, shl01), m30)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                _mm512_and_si512(_mm512_srlv_epi16(h, shr23), m30)),
            };
            for (int p = 0; p < 2; p++) {
                /* the half's scales 4p .. 4p+3, one per 16 values */
                const __m512i sv = _mm512_shuffle_epi8(sc4, pick16(4 * p, 4 * p + 1, 4 * p + 2, 4 * p + 3));
                for (int r = 0; r < R; r++) {
                    const __m512i x = _mm512_loadu_si512((const void *)(q8 + r * K + b * 256 + 128 * half + 64 * p));
                    acc2[r] = _mm512_dpwssd_epi32(acc2[r], _mm512_maddubs_epi16(u[p], x), sv);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i a = _mm256_add_epi32(
                acc[r], _mm256_add_epi32(_mm512_castsi512_si256(acc2[r]), _mm512_extracti64x4_epi64(acc2[r], 1)));
            tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(d * d8[r * (K / 256) + b]), tot[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(tot[r]);
}

/* R rows (Q4_K: 1..8, Q6_K: 1..4) against one weight row; the arguments of ggml_kernels.c's row kernels */
#define CASE(F, N)                                                                                            \
    case N: F(N, wr, nb, q8, d8, bs, K, out); return
void dyntree_q4k_q8_rows_vnni(int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                              const int16_t *bs, int64_t K, float *out) {
    switch (R) {
    CASE(q4k_vnni, 8); CASE(q4k_vnni, 7); CASE(q4k_vnni, 6); CASE(q4k_vnni, 5);
    CASE(q4k_vnni, 4); CASE(q4k_vnni, 3); CASE(q4k_vnni, 2); default: q4k_vnni(1, wr, nb, q8, d8, bs, K, out);
    }
}

void dyntree_q6k_q8_rows_vnni(int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                              const int16_t *bs, int64_t K, float *out) {
    switch (R) {
    CASE(q6k_vnni, 4); CASE(q6k_vnni, 3); CASE(q6k_vnni, 2); default: q6k_vnni(1, wr, nb, q8, d8, bs, K, out);
    }
}

/* v + 16 in the bytes whose bit of k is set (one vpaddb under the mask; SIMDe 0.7.4 has no masked byte add, so
 * its build blends v | 16 in: the same bytes, v < 16) */
static inline __attribute__((always_inline)) __m256i add16_where(__m256i v, uint32_t k) {
#ifdef DYNTREE_VNNI_SIMDE
    return _mm256_mask_blend_epi8(k, v, _mm256_or_si256(v, _mm256_set1_epi8(16)));
#else
    return _mm256_mask_add_epi8(v, (__mmask32)k, v, _mm256_set1_epi8(16));
#endif
}

/* Q5_0 weights against Q8_0 activations (ggml_kernels.c's q32_q8_rows): one vpdpbusd per block and row where the
 * AVX2 kernel issues two vpsignb, vpmaddubsw and vpmaddwd, and the quants' fifth bits added by one byte-masked add
 * from the 32-bit qh where it builds a byte mask in four instructions. vpdpbusd takes unsigned weights, so they are
 * the quants q in 0..31 and each int32 lane starts from corr = -16 * (its 4 activations' sum): lane i ends at
 * sum_{j=4i..4i+3} (q_j - 16) x_j, the AVX2 kernel's lane exactly. The float work is the AVX2 kernel's, in its
 * order, so the outputs are bit-identical. corr: [R][K / 4] int32 (ggml_kernels.c's q5_0_offsets).
 * (Q8_0 weights gained nothing this way: its AVX2 kernel reads at the memory's rate, CPU_KERNELS.md.) */
ROWS_KERNEL void q5_0_vnni(const int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                           const int32_t *corr, int64_t K, float *out) {
    __m256 tot[4];
    for (int r = 0; r < R; r++) tot[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i nib_shift = _mm256_setr_epi64x(0, 0, 4, 4); /* low nibbles in the low half, high in the high */
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wr + b * 22;
        const float d = f16(blk);
        const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 6)));
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        const __m256i w = add16_where(_mm256_and_si256(_mm256_srlv_epi64(q, nib_shift), m4), qh);
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(q8 + r * K + 32 * b));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(corr + r * (K / 4) + 8 * b));
            const __m256i p = _mm256_dpbusd_epi32(c, w, x);
            tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * d8[r * (K / 32) + b]), tot[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(tot[r]);
}

/* R rows (1, 2 or 4) of Q8_0 activations against one Q5_0 weight row */
void dyntree_q5_0_q8_rows_vnni(int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                               const int32_t *corr, int64_t K, float *out) {
    if (R == 4) q5_0_vnni(4, wr, nb, q8, d8, corr, K, out);
    else if (R == 2) q5_0_vnni(2, wr, nb, q8, d8, corr, K, out);
    else q5_0_vnni(1, wr, nb, q8, d8, corr, K, out);
}

/* the int32 at p in every lane of a zmm (q8_blocks.h's bcast_i32 on ymm) */
static inline __attribute__((always_inline)) __m512i bcast512_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* acc + x . w per int32 lane: 4 unsigned weight bytes w by the 4 signed activation bytes at x (one int32, in every
 * lane). The real build takes x as vpdpbusd's broadcast memory operand, one instruction where the intrinsics'
 * _mm512_set1_epi32 makes GCC issue a vpbroadcastd beside it; SIMDe's build the intrinsics. */
static inline __attribute__((always_inline)) __m512i dpbusd_x(__m512i acc, __m512i w, const int8_t *x) {
#ifdef DYNTREE_VNNI_SIMDE
    return _mm512_dpbusd_epi32(acc, w, bcast512_i32(x));
#else
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
#endif
}

/* zmm of group g's 32 bytes at o + at (low half) and group g+1's at o2 + at (high half) */
static inline __attribute__((always_inline)) __m512i two_groups(const uint8_t *o, const uint8_t *o2, int64_t at) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(o + at))),
                              _mm256_loadu_si256((const __m256i *)(o2 + at)), 1);
}

/* ymm of the 16 bytes at o + at (low half) and the 16 at o2 + at (high half) */
static inline __attribute__((always_inline)) __m256i two_16(const uint8_t *o, const uint8_t *o2, int64_t at) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(o + at))),
                                   _mm_loadu_si128((const __m128i *)(o2 + at)), 1);
}

/* q8_blocks.h's q4k_x8_block_floats on two groups at once (lanes 0..7: the group at o, 8..15: at o2): the same
 * operations per lane, so the same bits, on half the instructions */
ROWS_KERNEL void q4k_x8_block_floats2(const int R, const uint8_t *o, const uint8_t *o2, const __m512i *isum,
                                      int64_t b, const float *d8, const int16_t *b32, int64_t K, __m512 *acc) {
    const __m512 d = cvtph512(two_16(o, o2, 0)), dmin = cvtph512(two_16(o, o2, 16));
    __m512i m16[4];
    for (int p = 0; p < 4; p++) m16[p] = cvtepu8_16_512(two_16(o, o2, Q4K_X8_MN + 16 * p));
    for (int r = 0; r < R; r++) {
        const int16_t *bs = b32 + r * (K / 32) + b * 8;
        __m512i nsum = madd512(m16[0], bcast512_i32(bs));
        for (int p = 1; p < 4; p++) nsum = _mm512_add_epi32(nsum, madd512(m16[p], bcast512_i32(bs + 2 * p)));
        const __m512 dx = _mm512_set1_ps(d8[r * (K / 256) + b]);
        acc[r] = _mm512_fmadd_ps(cvtepi32_ps512(isum[r]), _mm512_mul_ps(d, dx), acc[r]);
        acc[r] = _mm512_fnmadd_ps(cvtepi32_ps512(nsum), _mm512_mul_ps(dmin, dx), acc[r]);
    }
}

/* q8_blocks.h's q6k_x8_offsets on two groups at once, as above */
ROWS_KERNEL void q6k_x8_offsets2(const int R, const uint8_t *o, const uint8_t *o2, int64_t b, const int16_t *b16,
                                 int64_t K, __m512i *isum) {
    __m512i pairs[8];
    for (int p = 0; p < 8; p++) {
        const __m128i a = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(o + 16 + 16 * p)),
                                            _mm_loadl_epi64((const __m128i *)(o + 16 + 16 * p + 8)));
        const __m128i a2 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(o2 + 16 + 16 * p)),
                                             _mm_loadl_epi64((const __m128i *)(o2 + 16 + 16 * p + 8)));
        pairs[p] = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(a), a2, 1));
    }
    for (int r = 0; r < R; r++) {
        const int16_t *bs = b16 + r * (K / 16) + b * 16;
        __m512i t = madd512(pairs[0], bcast512_i32(bs));
        for (int p = 1; p < 8; p++) t = _mm512_add_epi32(t, madd512(pairs[p], bcast512_i32(bs + 2 * p)));
        isum[r] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(t, 5));
    }
}

/* q8_blocks.h's q6k_x8_block_floats on two groups at once, as above */
ROWS_KERNEL void q6k_x8_block_floats2(const int R, const uint8_t *o, const uint8_t *o2, const __m512i *isum,
                                      int64_t b, const float *d8, int64_t K, __m512 *acc) {
    const __m512 d = cvtph512(two_16(o, o2, 0));
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_fmadd_ps(cvtepi32_ps512(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(d8[r * (K / 256) + b])),
                                 acc[r]);
}

/* acc[r] = group g's columns of row r (the low half), acc[X8_VNNI_ROWS + r] group g+1's */
ROWS_KERNEL void x8_split(const int R, const __m512 *facc, __m256 *acc) {
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_castps512_ps256(facc[r]);
        acc[X8_VNNI_ROWS + r] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(facc[r]), 1));
    }
}

/* x8_prefetch for two groups read side by side (o, and o2 = o + gstride): a pair's blocks X8_PREFETCH_BLOCKS
 * ahead, or past its end the next pair's (the low group's stream then runs into the high group's bytes, which are
 * being read, and the high group's into the next pair's low group) */
static inline __attribute__((always_inline)) void x8_prefetch2(int64_t b, int64_t nb, const uint8_t *o,
                                                               const uint8_t *o2, int64_t gstride, int bytes,
                                                               int part, int parts) {
    x8_prefetch(b + X8_PREFETCH_BLOCKS < nb ? o : o2 + gstride, bytes, part, parts);
    x8_prefetch(o2, bytes, part, parts);
}

/* Q4_K x8 (ggml_kernels.c's q4k_x8_tile, its layout and arithmetic): a sub-block's products of 8 columns by one
 * activation row summed by 8 vpdpbusd into int32 lanes, then times the columns' scales (vpmulld): 11 instructions
 * per row and sub-block where the AVX2 tile issues 17 (8 vpmaddubsw, 7 int16 adds, a vpmaddwd and an add). Two
 * chains of 4 per row (low and high nibbles), joined before the scales: one chain of 8 was bound by vpdpbusd's
 * latency. The same integer sums, so the same outputs bit for bit. */
ROWS_KERNEL void q4k_x8_vnni(const int R, const uint8_t *wg, int64_t nb, const int8_t *q8, const float *d8,
                             const int16_t *b32, int64_t K, __m256 *acc) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * Q4K_X8_BYTES;
        __m256i isum[X8_VNNI_ROWS];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i dlo[X8_VNNI_ROWS], dhi[X8_VNNI_ROWS];
            x8_prefetch(o, Q4K_X8_BYTES, j, 8);
            for (int r = 0; r < R; r++) dlo[r] = dhi[r] = _mm256_setzero_si256();
            for (int l = 0; l < 4; l++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(o + Q4K_X8_QS + 128 * j + 32 * l));
                const __m256i lo = _mm256_and_si256(bytes, mask);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
                for (int r = 0; r < R; r++) {
                    const int8_t *x = q8 + r * K + b * 256 + 32 * j + 4 * l;
                    dlo[r] = _mm256_dpbusd_epi32(dlo[r], lo, bcast_i32(x));
                    dhi[r] = _mm256_dpbusd_epi32(dhi[r], hi, bcast_i32(x + 16));
                }
            }
            const __m256i s32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(o + Q4K_X8_SC + 8 * j)));
            for (int r = 0; r < R; r++)
                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(_mm256_add_epi32(dlo[r], dhi[r]), s32));
        }
        q4k_x8_block_floats(R, o, isum, b, d8, b32, K, acc);
    }
}

/* Q6_K x8 (ggml_kernels.c's q6k_x8_tile): a sub-block's 16 values x 8 columns by 4 vpdpbusd into int32 lanes, then
 * times the columns' scales (vpmulld): the same integers, so the same outputs bit for bit */
ROWS_KERNEL void q6k_x8_vnni(const int R, const uint8_t *wg, int64_t nb, const int8_t *q8, const float *d8,
                             const int16_t *b16, int64_t K, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * Q6K_X8_BYTES;
        __m256i isum[X8_VNNI_ROWS];
        q6k_x8_offsets(R, o, b, b16, K, isum);
        for (int s = 0; s < 16; s++) {
            __m256i u[4];
            x8_prefetch(o, Q6K_X8_BYTES, s, 16);
            q6k_x8_quants(o, s, m4, m30, u);
            const __m256i s32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + 16 + 8 * s)));
            for (int r = 0; r < R; r++) {
                const int8_t *x = q8 + r * K + b * 256 + 16 * s;
                const __m256i zero = _mm256_setzero_si256();  /* two chains of 2: vpdpbusd's latency */
                const __m256i da = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, u[0], bcast_i32(x)), u[1],
                                                       bcast_i32(x + 4));
                const __m256i db = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, u[2], bcast_i32(x + 8)), u[3],
                                                       bcast_i32(x + 12));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(_mm256_add_epi32(da, db), s32));
            }
        }
        q6k_x8_block_floats(R, o, isum, b, d8, K, acc);
    }
}

/* Q4_K x8 (ggml_kernels.c's q4k_x8_tile, its layout and arithmetic) on zmm, two groups of 8 columns: group g's
 * bytes in the low half, g+1's (gstride on) in the high half, so each activation broadcast serves 16 columns.
 * A sub-block's products of the columns by one activation row summed by 8 vpdpbusd into int32 lanes, then times
 * the columns' scales (vpmulld). Up to X8_VNNI_ROWS activation rows per tile, so one unpacking of the nibbles
 * serves up to 8 rows; below 4 rows each row runs two chains (low and high nibbles), joined before the scales,
 * since one chain of 8 is bound by vpdpbusd's latency. acc[r] gets group g's columns of row r, acc[X8_VNNI_ROWS + r]
 * group g+1's. The same integer sums as the AVX2 tiles, so the same outputs bit for bit. */
ROWS_KERNEL void q4k_x8_vnni2(const int R, const uint8_t *wg, int64_t gstride, int64_t nb,
                             const int8_t *q8, const float *d8, const int16_t *b32, int64_t K, __m256 *acc) {
    const int chains = R < 4 ? 2 : 1;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 facc[X8_VNNI_ROWS];
    for (int r = 0; r < R; r++) facc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * Q4K_X8_BYTES, *o2 = o + gstride;
        __m512i isum[X8_VNNI_ROWS];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            __m512i dlo[X8_VNNI_ROWS], dhi[X8_VNNI_ROWS];
            x8_prefetch2(b, nb, o, o2, gstride, Q4K_X8_BYTES, j, 8);
            for (int r = 0; r < R; r++) dlo[r] = dhi[r] = _mm512_setzero_si512();
            for (int l = 0; l < 4; l++) {
                const __m512i bytes = two_groups(o, o2, Q4K_X8_QS + 128 * j + 32 * l);
                const __m512i lo = _mm512_and_si512(bytes, mask);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);
                for (int r = 0; r < R; r++) dlo[r] = dpbusd_x(dlo[r], lo, q8 + r * K + b * 256 + 32 * j + 4 * l);
                for (int r = 0; r < R; r++) {
                    const int8_t *x = q8 + r * K + b * 256 + 32 * j + 4 * l + 16;
                    if (chains == 2) dhi[r] = dpbusd_x(dhi[r], hi, x);
                    else dlo[r] = dpbusd_x(dlo[r], hi, x);
                }
            }
            const __m512i s32 = _mm512_inserti64x4(  /* (one vpmovzxbd to zmm is not in SIMDe) */
                _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(o + Q4K_X8_SC + 8 * j)))),
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(o2 + Q4K_X8_SC + 8 * j))), 1);
            for (int r = 0; r < R; r++) {
                const __m512i d = chains == 2 ? _mm512_add_epi32(dlo[r], dhi[r]) : dlo[r];
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(d, s32));
            }
        }
        q4k_x8_block_floats2(R, o, o2, isum, b, d8, b32, K, facc);
    }
    x8_split(R, facc, acc);
}

/* Q6_K x8 (ggml_kernels.c's q6k_x8_tile) on zmm, two groups as above: a sub-block's 16 values x the columns by 4
 * vpdpbusd into int32 lanes, then times the columns' scales (vpmulld); up to X8_VNNI_ROWS rows per tile, two chains
 * per row below 4 rows. The same integers, so the same outputs bit for bit. */
ROWS_KERNEL void q6k_x8_vnni2(const int R, const uint8_t *wg, int64_t gstride, int64_t nb,
                             const int8_t *q8, const float *d8, const int16_t *b16, int64_t K, __m256 *acc) {
    const int chains = R < 4 ? 2 : 1;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 facc[X8_VNNI_ROWS];
    for (int r = 0; r < R; r++) facc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * Q6K_X8_BYTES, *o2 = o + gstride;
        __m512i isum[X8_VNNI_ROWS];
        q6k_x8_offsets2(R, o, o2, b, b16, K, isum);
        for (int s = 0; s < 16; s++) {
            x8_prefetch2(b, nb, o, o2, gstride, Q6K_X8_BYTES, s, 16);
            /* q6k_x8_quants on both groups: u[t] = values 16 s + 4 t .. + 3 of the columns, 0..63 */
            const __m512i l0 = two_groups(o, o2, 144 + 64 * s), l1 = two_groups(o, o2, 144 + 64 * s + 32);
            const __m512i h = two_groups(o, o2, 144 + 1024 + 32 * s);
            const __m512i u[4] = {
                _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30)),
                _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(_mm512_slli_epi16(h, 2), m30)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_and_si512(h, m30)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                _mm512_and_si512(_mm512_srli_epi16(h, 2), m30)),
            };
            const __m512i s32 = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + 16 + 8 * s)))),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o2 + 16 + 8 * s))), 1);
            __m512i da[X8_VNNI_ROWS], db[X8_VNNI_ROWS];
            for (int r = 0; r < R; r++) da[r] = db[r] = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++)
                for (int r = 0; r < R; r++) {
                    const int8_t *x = q8 + r * K + b * 256 + 16 * s + 4 * t;
                    if (chains == 2 && t >= 2) db[r] = dpbusd_x(db[r], u[t], x);
                    else da[r] = dpbusd_x(da[r], u[t], x);
                }
            for (int r = 0; r < R; r++) {
                const __m512i d = chains == 2 ? _mm512_add_epi32(da[r], db[r]) : da[r];
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(d, s32));
            }
        }
        q6k_x8_block_floats2(R, o, o2, isum, b, d8, K, facc);
    }
    x8_split(R, facc, acc);
}

/* R = 1..X8_VNNI_ROWS activation rows against G = 1 (ymm) or 2 (zmm) groups of 8 weight rows (gstride bytes apart)
 * of a Q4_K (q6k 0) or Q6_K (q6k 1) weight in the x8 layout; acc[r]: group g's columns of row r, acc[X8_VNNI_ROWS
 * + r] group g+1's */
#define X8_CASE(F, F2, N)                                                                                     \
    case N:                                                                                                   \
        if (G == 2) F2(N, wg, gstride, nb, q8, d8, bs, K, acc);                                               \
        else F(N, wg, nb, q8, d8, bs, K, acc);                                                                \
        return
#define X8_CASES(F, F2)                                                                                       \
    switch (R) {                                                                                              \
        X8_CASE(F, F2, 8); X8_CASE(F, F2, 7); X8_CASE(F, F2, 6); X8_CASE(F, F2, 5);                           \
        X8_CASE(F, F2, 4); X8_CASE(F, F2, 3); X8_CASE(F, F2, 2); default: X8_CASE(F, F2, 1);                  \
    }
void dyntree_x8_tile_vnni(int q6k, int R, int G, const uint8_t *wg, int64_t gstride, int64_t nb, const int8_t *q8,
                          const float *d8, const int16_t *bs, int64_t K, __m256 *acc) {
    if (q6k) X8_CASES(q6k_x8_vnni, q6k_x8_vnni2) else X8_CASES(q4k_x8_vnni, q4k_x8_vnni2)
}

/* Q5_0 x8 (ggml_kernels.c's layout; the tile in q5_0_x8.h): one vpdpbusd per 4 values, 8 columns and row, and the
 * fifth bits by one byte-masked add; the AVX2 tile's integer sums and float work, so its bits */
static inline __attribute__((always_inline)) __m256i q50x8_dpbusd_vnni(__m256i acc, __m256i w, const int8_t *x) {
    return _mm256_dpbusd_epi32(acc, w, bcast_i32(x));
}

#define Q50X8_NAME q5_0_x8_tile_vnni
#define Q50X8_DPBUSD q50x8_dpbusd_vnni
#define Q50X8_ADD16 add16_where
#include "q5_0_x8.h"

void dyntree_q5_0_x8_tile_vnni(int R, const uint8_t *wg, int64_t nb, const int8_t *q8, const float *d8,
                               const int32_t *bsum, int64_t K, __m256 *acc) {
    switch (R) {
    case 8: q5_0_x8_tile_vnni(8, wg, nb, q8, d8, bsum, K, acc); return;
    case 7: q5_0_x8_tile_vnni(7, wg, nb, q8, d8, bsum, K, acc); return;
    case 6: q5_0_x8_tile_vnni(6, wg, nb, q8, d8, bsum, K, acc); return;
    case 5: q5_0_x8_tile_vnni(5, wg, nb, q8, d8, bsum, K, acc); return;
    case 4: q5_0_x8_tile_vnni(4, wg, nb, q8, d8, bsum, K, acc); return;
    case 3: q5_0_x8_tile_vnni(3, wg, nb, q8, d8, bsum, K, acc); return;
    case 2: q5_0_x8_tile_vnni(2, wg, nb, q8, d8, bsum, K, acc); return;
    default: q5_0_x8_tile_vnni(1, wg, nb, q8, d8, bsum, K, acc);
    }
}
