/* The Q5_0 x8 tile (the layout: ggml_kernels.c, "Q5_0 x8"), written once and compiled twice: by ggml_kernels.c on
 * AVX2 and by ggml_vnni.c on AVX-512 VNNI. Each defines, before including this file:
 *
 *   Q50X8_NAME                the function's name
 *   Q50X8_DPBUSD(acc, w, x)   acc + per int32 lane: its 4 unsigned bytes of w times the 4 signed bytes at x
 *                             (AVX2: vpmaddubsw, vpmaddwd, vpaddd; VNNI: one vpdpbusd)
 *   Q50X8_ADD16(v, bits)      v + 16 in the bytes whose bit of the 32-bit `bits` is set (v < 16)
 *
 * Per block b and activation row r the 8 columns' integer sums are exact (int32 lanes, |sum| < 2^17), whatever
 * instructions add them: I_c = sum_k (q_ck - 16) x_k, started from bsum[r][b] = -16 * sum_k x_k and added to by the
 * quants q in 0..31 (unsigned, vpdpbusd's first operand). Then, in block order from 0,
 * acc[r] = fma(float(I), d_c * dx_rb, acc[r]) with d_c * dx_rb one float product: both builds give the same bits. */
static inline __attribute__((always_inline)) void Q50X8_NAME(const int R, const uint8_t *wg, int64_t nb,
                                                             const int8_t *q8, const float *d8, const int32_t *bsum,
                                                             int64_t K, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * Q5_0_X8_BYTES;
        x8_prefetch(o, Q5_0_X8_BYTES, 0, 1);
        __m256i lo[X8_VNNI_ROWS], hi[X8_VNNI_ROWS]; /* two sums per row: values 0..15 and 16..31, each 4 deep */
        for (int r = 0; r < R; r++) {
            lo[r] = _mm256_set1_epi32(bsum[r * nb + b]);
            hi[r] = _mm256_setzero_si256();
        }
        for (int l = 0; l < 4; l++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(o + 48 + 32 * l));
            uint32_t k0, k1;
            memcpy(&k0, o + 16 + 4 * l, 4);
            memcpy(&k1, o + 32 + 4 * l, 4);
            const __m256i w0 = Q50X8_ADD16(_mm256_and_si256(q, m4), k0);
            const __m256i w1 = Q50X8_ADD16(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), k1);
            for (int r = 0; r < R; r++) {
                const int8_t *x = q8 + r * K + 32 * b + 4 * l;
                lo[r] = Q50X8_DPBUSD(lo[r], w0, x);
                hi[r] = Q50X8_DPBUSD(hi[r], w1, x + 16);
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo[r], hi[r])),
                                     _mm256_mul_ps(dw, _mm256_set1_ps(d8[r * nb + b])), acc[r]);
    }
}
