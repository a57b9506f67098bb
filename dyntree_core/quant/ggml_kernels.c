/* GGML weight blocks (Q4_K, Q6_K, Q5_0, Q8_0) times float32 activations, on AVX2 + FMA + F16C.
 *
 * dyntree_ggml_dequantize gives every weight exactly the float32 value of the gguf package's reference
 * code (Q4_K: fma(q, d*sc, -dmin*m) with d*sc, q*d*sc and dmin*m exact in float32: one rounding, like
 * numpy's (d*sc)*q - dmin*m; Q6_K, Q5_0, Q8_0: products of at most 24 significant bits, exact).
 * dyntree_ggml_matmul multiplies float32 activations by the same weights with float32 sums, grouped the
 * way the blocks are (sum(w x) over a group of one scale = s * sum(q x) - o * sum(x)): it agrees with the
 * float32 model's product to float32 rounding. Rows of x are independent (no activation quantization).
 *
 * Weights: row-major [N, K] as the GGUF stores them (row n = K / block_elems blocks).
 * Threads: OpenMP, linked against the libgomp torch already loaded (one thread pool).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

#include "avx2_sum.h"
#include "q8_blocks.h"

/* GGML type ids; T_Q4_K_X8, T_Q6_K_X8 and T_Q5_0_X8 are ours (not GGML's): rows repacked 8 at a time
 * (dyntree_q4k_x8_repack, dyntree_q6k_x8_repack, dyntree_q5_0_x8_repack), taken by dyntree_ggml_matmul_q8v (int8
 * activations) only */
enum { T_Q4_K = 12, T_Q6_K = 14, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K_X8 = 112, T_Q6_K_X8 = 114, T_Q5_0_X8 = 106 };

static void x8_products(int type, const uint8_t *w, const int8_t *q8, const float *d8, const int16_t *bs,
                        int64_t ldb, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                        int vnni);
static void q5_0_x8_products(const uint8_t *w, const int8_t *q8, const float *d8, const int32_t *bsum,
                             const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int vnni);

/* 8 unsigned bytes -> 8 floats */
static inline __m256 u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline void scale_min_k4(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

/* Q4_K: 144 bytes -> 256 floats */
static inline void deq_q4_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *sc = b + 4, *qs = b + 16;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        int s1, m1, s2, m2;
        scale_min_k4(2 * j, sc, &s1, &m1);
        scale_min_k4(2 * j + 1, sc, &s2, &m2);
        const __m256 d1 = _mm256_set1_ps(d * (float)s1), o1 = _mm256_set1_ps(dmin * (float)m1);
        const __m256 d2 = _mm256_set1_ps(d * (float)s2), o2 = _mm256_set1_ps(dmin * (float)m2);
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        uint8_t lo[32], hi[32];
        _mm256_storeu_si256((__m256i *)lo, _mm256_and_si256(bytes, mask));
        _mm256_storeu_si256((__m256i *)hi, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask));
        float *y1 = y + 64 * j, *y2 = y1 + 32;
        for (int k = 0; k < 4; k++) {
            _mm256_storeu_ps(y1 + 8 * k, _mm256_fmsub_ps(u8x8(lo + 8 * k), d1, o1));
            _mm256_storeu_ps(y2 + 8 * k, _mm256_fmsub_ps(u8x8(hi + 8 * k), d2, o2));
        }
    }
}

/* Q6_K half block (ql[64], qh[32]) -> 4 x 32 quants in -32..31 */
static inline void q6k_unpack(const uint8_t *ql, const uint8_t *qh, int8_t q[4][32]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), off = _mm256_set1_epi8(32);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(qh));
    __m256i v;
    v = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
    _mm256_storeu_si256((__m256i *)q[0], _mm256_sub_epi8(v, off));
    v = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
    _mm256_storeu_si256((__m256i *)q[1], _mm256_sub_epi8(v, off));
    v = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
    _mm256_storeu_si256((__m256i *)q[2], _mm256_sub_epi8(v, off));
    v = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
    _mm256_storeu_si256((__m256i *)q[3], _mm256_sub_epi8(v, off));
}

/* Q6_K: 210 bytes (ql[128], qh[64], scales[16] int8, d fp16) -> 256 floats */
static inline void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    for (int half = 0; half < 2; half++) {
        int8_t q[4][32];
        q6k_unpack(ql, qh, q);
        for (int g = 0; g < 4; g++) {          /* 32 values, 2 scales of 16 each */
            for (int s = 0; s < 2; s++) {
                const __m256 ds = _mm256_set1_ps(d * (float)sc[2 * g + s]);
                for (int k = 0; k < 2; k++) {
                    const int i = 16 * s + 8 * k;
                    _mm256_storeu_ps(y + 32 * g + i, _mm256_mul_ps(ds, i8x8(q[g] + i)));
                }
            }
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* Q5_0: 22 bytes (d fp16, qh[4], qs[16]) -> 32 floats: d * (q - 16) */
static inline void deq_q5_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    int8_t q[32];
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16);
        q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
    const __m256 vd = _mm256_set1_ps(d);
    for (int k = 0; k < 4; k++) _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(vd, i8x8(q + 8 * k)));
}

/* Q8_0: 34 bytes (d fp16, qs[32] int8) -> 32 floats */
static inline void deq_q8_0(const uint8_t *b, float *y) {
    const __m256 vd = _mm256_set1_ps(f16(b));
    const int8_t *q = (const int8_t *)(b + 2);
    for (int k = 0; k < 4; k++) _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(vd, i8x8(q + 8 * k)));
}

static int block_info(int type, int *elems, int *bytes) {
    switch (type) {
    case T_Q4_K: *elems = 256; *bytes = 144; return 0;
    case T_Q6_K: *elems = 256; *bytes = 210; return 0;
    case T_Q5_0: *elems = 32; *bytes = 22; return 0;
    case T_Q8_0: *elems = 32; *bytes = 34; return 0;
    default: return -1;
    }
}

static inline void deq_block(int type, const uint8_t *b, float *y) {
    switch (type) {
    case T_Q4_K: deq_q4_k(b, y); break;
    case T_Q6_K: deq_q6_k(b, y); break;
    case T_Q5_0: deq_q5_0(b, y); break;
    default: deq_q8_0(b, y); break;
    }
}

int dyntree_ggml_block_info(int type, int *elems, int *bytes) { return block_info(type, elems, bytes); }

/* w [n_rows, K] in blocks -> out [n_rows, K] float32 */
int dyntree_ggml_dequantize(int type, const uint8_t *w, float *out, int64_t n_rows, int64_t K) {
    int be, bb;
    if (block_info(type, &be, &bb) || K % be) return -1;
    const int64_t nb = K / be;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_rows; n++)
        for (int64_t b = 0; b < nb; b++) deq_block(type, w + (n * nb + b) * bb, out + n * K + b * be);
    return 0;
}

/* Row kernels: R activation rows against one weight row, the block's integers converted to float once
 * and multiplied by each row; per group sum(q * x) is scaled once (w = s*q - o => sum(w x) = s*sum(q x) -
 * o*sum(x)). Sums of x per 32 values (``sumx``, [R][K/32]) are computed once per call. */

#define Q4K_ROWS(R)                                                                                        \
    static void q4k_rows_##R(const uint8_t *wr, int64_t nb, const float *x, int64_t ldx, const float *sumx, \
                             int64_t ng, float *out) {                                                       \
        __m256 tot[R];                                                                                       \
        float off[R];                                                                                        \
        for (int r = 0; r < R; r++) {                                                                        \
            tot[r] = _mm256_setzero_ps();                                                                    \
            off[r] = 0.0f;                                                                                   \
        }                                                                                                    \
        const __m256i mask = _mm256_set1_epi8(0x0F);                                                         \
        for (int64_t b = 0; b < nb; b++) {                                                                   \
            const uint8_t *blk = wr + b * 144;                                                               \
            const float d = f16(blk), dmin = f16(blk + 2);                                                   \
            const uint8_t *sc = blk + 4, *qs = blk + 16;                                                     \
            for (int j = 0; j < 4; j++) {                                                                    \
                int s1, m1, s2, m2;                                                                          \
                scale_min_k4(2 * j, sc, &s1, &m1);                                                           \
                scale_min_k4(2 * j + 1, sc, &s2, &m2);                                                       \
                const __m256 d1 = _mm256_set1_ps(d * (float)s1), d2 = _mm256_set1_ps(d * (float)s2);         \
                const float o1 = dmin * (float)m1, o2 = dmin * (float)m2;                                    \
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));                    \
                const __m256i lo = _mm256_and_si256(bytes, mask);                                            \
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);                      \
                const __m128i l0 = _mm256_castsi256_si128(lo), l1 = _mm256_extracti128_si256(lo, 1);        \
                const __m128i h0 = _mm256_castsi256_si128(hi), h1 = _mm256_extracti128_si256(hi, 1);        \
                const __m256 ql0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l0));                            \
                const __m256 ql1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(l0, 8)));         \
                const __m256 ql2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l1));                            \
                const __m256 ql3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(l1, 8)));         \
                const __m256 qh0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h0));                            \
                const __m256 qh1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(h0, 8)));         \
                const __m256 qh2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h1));                            \
                const __m256 qh3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(h1, 8)));         \
                const int64_t g = b * 8 + 2 * j;                                                             \
                for (int r = 0; r < R; r++) {                                                                \
                    const float *xr = x + r * ldx + b * 256 + 64 * j;                                        \
                    __m256 a = _mm256_mul_ps(ql0, _mm256_loadu_ps(xr));                                      \
                    a = _mm256_fmadd_ps(ql1, _mm256_loadu_ps(xr + 8), a);                                    \
                    a = _mm256_fmadd_ps(ql2, _mm256_loadu_ps(xr + 16), a);                                   \
                    a = _mm256_fmadd_ps(ql3, _mm256_loadu_ps(xr + 24), a);                                   \
                    tot[r] = _mm256_fmadd_ps(a, d1, tot[r]);                                                 \
                    a = _mm256_mul_ps(qh0, _mm256_loadu_ps(xr + 32));                                        \
                    a = _mm256_fmadd_ps(qh1, _mm256_loadu_ps(xr + 40), a);                                   \
                    a = _mm256_fmadd_ps(qh2, _mm256_loadu_ps(xr + 48), a);                                   \
                    a = _mm256_fmadd_ps(qh3, _mm256_loadu_ps(xr + 56), a);                                   \
                    tot[r] = _mm256_fmadd_ps(a, d2, tot[r]);                                                 \
                    off[r] += o1 * sumx[r * ng + g] + o2 * sumx[r * ng + g + 1];                             \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) out[r] = hsum(tot[r]) - off[r];                                          \
    }
Q4K_ROWS(1)
Q4K_ROWS(2)
Q4K_ROWS(4)

#define Q6K_ROWS(R)                                                                                        \
    static void q6k_rows_##R(const uint8_t *wr, int64_t nb, const float *x, int64_t ldx, float *out) {      \
        __m256 tot[R];                                                                                       \
        for (int r = 0; r < R; r++) tot[r] = _mm256_setzero_ps();                                            \
        for (int64_t b = 0; b < nb; b++) {                                                                   \
            const uint8_t *blk = wr + b * 210;                                                               \
            const int8_t *sc = (const int8_t *)(blk + 192);                                                  \
            const float d = f16(blk + 208);                                                                  \
            for (int half = 0; half < 2; half++) {                                                           \
                int8_t q[4][32];                                                                             \
                q6k_unpack(blk + 64 * half, blk + 128 + 32 * half, q);                                       \
                for (int g = 0; g < 8; g++) {                                                                \
                    const __m256 ds = _mm256_set1_ps(d * (float)sc[8 * half + g]);                           \
                    const __m256 q0 = i8x8(q[g >> 1] + 16 * (g & 1));                                        \
                    const __m256 q1 = i8x8(q[g >> 1] + 16 * (g & 1) + 8);                                    \
                    for (int r = 0; r < R; r++) {                                                            \
                        const float *xr = x + r * ldx + b * 256 + 128 * half + 16 * g;                       \
                        __m256 a = _mm256_mul_ps(q0, _mm256_loadu_ps(xr));                                   \
                        a = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8), a);                                 \
                        tot[r] = _mm256_fmadd_ps(a, ds, tot[r]);                                             \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) out[r] = hsum(tot[r]);                                                   \
    }
Q6K_ROWS(1)
Q6K_ROWS(2)
Q6K_ROWS(4)

/* other types: the block dequantized to float, then multiplied by each row */
static void deq_rows(int type, int be, int bb, const uint8_t *wr, int64_t nb, const float *x, int64_t ldx, int R,
                     float *buf, float *out) {
    __m256 tot[4];
    for (int r = 0; r < R; r++) tot[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        deq_block(type, wr + b * bb, buf);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * ldx + b * be;
            for (int i = 0; i < be; i += 8)
                tot[r] = _mm256_fmadd_ps(_mm256_load_ps(buf + i), _mm256_loadu_ps(xr + i), tot[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(tot[r]);
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T (+ bias [N]) */
int dyntree_ggml_matmul(int type, const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y,
                        int64_t ldy, int64_t M, int64_t N, int64_t K) {
    int be, bb;
    if (block_info(type, &be, &bb) || K % be) return -1;
    const int64_t nb = K / be, ng = K / 32;
    const int64_t row_bytes = nb * bb;
    float *sumx = NULL;
    if (type == T_Q4_K) {
        sumx = (float *)malloc((size_t)(M * ng) * sizeof(float));
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < ng; g++) {
                __m256 s = _mm256_loadu_ps(x + m * ldx + 32 * g);
                s = _mm256_add_ps(s, _mm256_loadu_ps(x + m * ldx + 32 * g + 8));
                s = _mm256_add_ps(s, _mm256_loadu_ps(x + m * ldx + 32 * g + 16));
                s = _mm256_add_ps(s, _mm256_loadu_ps(x + m * ldx + 32 * g + 24));
                sumx[m * ng + g] = hsum(s);
            }
    }
#pragma omp parallel
    {
        float buf[256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *wr = w + n * row_bytes;
            const float bn = bias ? bias[n] : 0.0f;
            for (int64_t m0 = 0; m0 < M;) {
                const int64_t left = M - m0;
                const int R = left >= 4 ? 4 : (left >= 2 ? 2 : 1);
                float out[4];
                const float *xm = x + m0 * ldx;
                if (type == T_Q4_K) {
                    const float *sm = sumx + m0 * ng;
                    if (R == 4) q4k_rows_4(wr, nb, xm, ldx, sm, ng, out);
                    else if (R == 2) q4k_rows_2(wr, nb, xm, ldx, sm, ng, out);
                    else q4k_rows_1(wr, nb, xm, ldx, sm, ng, out);
                } else if (type == T_Q6_K) {
                    if (R == 4) q6k_rows_4(wr, nb, xm, ldx, out);
                    else if (R == 2) q6k_rows_2(wr, nb, xm, ldx, out);
                    else q6k_rows_1(wr, nb, xm, ldx, out);
                } else {
                    deq_rows(type, be, bb, wr, nb, xm, ldx, R, buf, out);
                }
                for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n] = out[r] + bn;
                m0 += R;
            }
        }
    }
    free(sumx);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * int8 activations (llama.cpp's way on x86: Q8_K): each activation row quantized per 256 values to int8 with
 * one float scale (d = max|x| / 127, q = round(x / d)), then integer dot products with the weight's integers
 * (vpmaddubsw: 32 multiply-adds per instruction) and one float multiply per 256 weights. Faster than the float
 * kernels where they are compute-bound, at the price of the activation rounding (|error| <= d/2 per value);
 * every M uses the same arithmetic, and rows stay independent.
 * --------------------------------------------------------------------------------------------------------- */

/* max |x[i]| over n floats (n a multiple of 8) */
static inline float absmax_f32(const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* 32 floats times is, rounded to nearest, stored as 32 int8 in order */
static inline void quantize_32_i8(const float *x, __m256 is, int8_t *q) {
    __m256i v[4];
    for (int k = 0; k < 4; k++)
        v[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), is),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
}

static void quantize_row_q8k(const float *x, int64_t K, int8_t *q, float *d, int16_t *bsums) {
    for (int64_t b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        const float mx = absmax_f32(xb, 256);
        int8_t *qb = q + 256 * b;
        if (mx == 0.0f) {
            memset(qb, 0, 256);
            d[b] = 0.0f;
            for (int j = 0; j < 16; j++) bsums[16 * b + j] = 0;
            continue;
        }
        const __m256 is = _mm256_set1_ps(127.0f / mx);
        for (int i = 0; i < 256; i += 32) quantize_32_i8(xb + i, is, qb + i);
        d[b] = mx / 127.0f;
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += qb[16 * j + i];
            bsums[16 * b + j] = (int16_t)s;
        }
    }
}

/* ---- Q4_K and Q6_K against Q8_K activations: a weight row against R = 1, 2, 4 (Q4_K: 8) activation rows ----
 * Each activation row keeps its own integer lanes and float accumulators, updated in block order with the same
 * operations whatever R is, so the result does not depend on M. The row kernels are written once with R as an
 * argument and instantiated with constants (always_inline), which unrolls their loops and keeps the accumulators
 * in registers (a fixed-size array indexed by the unrolled loop, not a variable-length one). */
#define ROWS_KERNEL static inline __attribute__((always_inline))

/* int16 lane a of the low 128-bit half broadcast over that half, lane b of the high half over the high half */
static inline __m256i bcast16(__m256i v, int a, int b) {
    const __m128i ca = _mm_set1_epi16((int16_t)((2 * a) | ((2 * a + 1) << 8)));
    const __m128i cb = _mm_set1_epi16((int16_t)((2 * b) | ((2 * b + 1) << 8)));
    return _mm256_shuffle_epi8(v, _mm256_set_m128i(cb, ca));
}

/* Q4_K (144 bytes: d, dmin fp16, 12 bytes of scales/mins, 128 bytes of nibbles; value = d*sc*q - dmin*m):
 * sum(w x) over a block = d*dx * sum_j sc_j * sum(q x)_j - dmin*dx * sum_j m_j * sum(x8)_j, with the sums of
 * the int8 activations per 32 (b32, [R][K/32]) computed once per call. 32 bytes of nibbles hold sub-block 2j
 * (low nibbles) and 2j+1 (high nibbles). */
ROWS_KERNEL void q4k_q8_rows(const int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                             const int16_t *b32, int64_t K, float *out) {
    __m256 tot[8];
    __m128 mins_acc[8];
    for (int r = 0; r < R; r++) {
        tot[r] = _mm256_setzero_ps();
        mins_acc[r] = _mm_setzero_ps();
    }
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wr + b * 144;
        const __m128 dd = f16x2(blk);
        const __m256i sm = q4k_scales_mins(blk + 4);
        const __m128i mins = _mm256_extracti128_si256(sm, 1);
        const __m256i sc = _mm256_permute2x128_si256(sm, sm, 0x00); /* the 8 scales in both halves */
        __m256i acc[8];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * j));
            const __m256i lo = _mm256_and_si256(bytes, mask);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
            const __m256i s1 = bcast16(sc, 2 * j, 2 * j), s2 = bcast16(sc, 2 * j + 1, 2 * j + 1);
            for (int r = 0; r < R; r++) {
                const int8_t *qr = q8 + r * K + b * 256 + 64 * j;
                const __m256i p1 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)qr));
                const __m256i p2 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(qr + 32)));
                acc[r] = _mm256_add_epi32(acc[r],
                                          _mm256_add_epi32(_mm256_madd_epi16(p1, s1), _mm256_madd_epi16(p2, s2)));
            }
        }
        for (int r = 0; r < R; r++)
            q4k_block_floats(acc[r], dd, mins, d8[r * (K / 256) + b], b32 + r * (K / 32) + b * 8, &tot[r],
                             &mins_acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = q4k_row_total(tot[r], mins_acc[r]);
}

/* Q6_K (210 bytes: ql[128] low nibbles, qh[64] top two bits, 16 int8 scales, d fp16; value = d*sc*(q - 32)):
 * per 128 values, 32 bytes of ql hold values 0..31 and 64..95 (low, high nibble), the next 32 values 32..63 and
 * 96..127, and byte i of qh the top bits of values i, i+32, i+64, i+96 (bit pairs 0-1, 2-3, 4-5, 6-7). The
 * unsigned q (0..63) multiplies the activations; the -32 comes back as -32 * sum_j sc_j * (sum of sub-block j's
 * activations), which starts the block's integer sum. */
static inline __m256i q6k_quants(const uint8_t *ql, const uint8_t *qh, int g) {
    const __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 32 * (g & 1)));
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    const __m256i low = _mm256_and_si256(g < 2 ? l : _mm256_srli_epi16(l, 4), _mm256_set1_epi8(0x0F));
    /* bit pair g of each qh byte moved to bits 4-5: shift by 4 - 2g (left for g < 2, right for g = 3) */
    const __m256i top = g == 0 ? _mm256_slli_epi16(h, 4) : g == 1 ? _mm256_slli_epi16(h, 2)
                      : g == 2 ? h : _mm256_srli_epi16(h, 2);
    return _mm256_or_si256(low, _mm256_and_si256(top, _mm256_set1_epi8(0x30)));
}

ROWS_KERNEL void q6k_q8_rows(const int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                             const int16_t *bs, int64_t K, float *out) {
    __m256 tot[4];
    for (int r = 0; r < R; r++) tot[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wr + b * 210;
        const float d = f16(blk + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256i sc_lo = _mm256_permute2x128_si256(sc16, sc16, 0x00); /* scales 0..7 in both halves */
        const __m256i sc_hi = _mm256_permute2x128_si256(sc16, sc16, 0x11); /* scales 8..15 in both halves */
        const __m256i m32 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc16, 5)); /* -32 sc */
        __m256i acc[4];
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_madd_epi16(m32, _mm256_loadu_si256((const __m256i *)(bs + r * (K / 16) + b * 16)));
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++)
            for (int g = 0; g < 4; g++) {
                const __m256i u = q6k_quants(blk + 64 * half, blk + 128 + 32 * half, g);
                /* 16 values of scale 2g, then 16 of scale 2g+1 (of this half's 8 scales) */
                const __m256i sv = bcast16(half ? sc_hi : sc_lo, 2 * g, 2 * g + 1);
                for (int r = 0; r < R; r++) {
                    const int8_t *qr = q8 + r * K + b * 256 + 128 * half + 32 * g;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)qr);
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sv));
                }
            }
        for (int r = 0; r < R; r++)
            tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(d * d8[r * (K / 256) + b]), tot[r]);
    }
    for (int r = 0; r < R; r++) out[r] = hsum(tot[r]);
}

#define KQ8_ROWS(T, R)                                                                                      \
    static void T##_q8_rows_##R(const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,            \
                                const int16_t *bs, int64_t K, float *out) {                                 \
        T##_q8_rows(R, wr, nb, q8, d8, bs, K, out);                                                         \
    }
KQ8_ROWS(q4k, 1)
KQ8_ROWS(q4k, 2)
KQ8_ROWS(q4k, 3)
KQ8_ROWS(q4k, 4)
KQ8_ROWS(q4k, 5)
KQ8_ROWS(q4k, 6)
KQ8_ROWS(q4k, 7)
KQ8_ROWS(q4k, 8)
KQ8_ROWS(q6k, 1)
KQ8_ROWS(q6k, 2)
KQ8_ROWS(q6k, 3)
KQ8_ROWS(q6k, 4)

/* Q5_0 / Q8_0 weights against activations quantized per 32 values (llama.cpp's Q8_0 activations) */
static void quantize_row_q8_0(const float *x, int64_t K, int8_t *q, float *d) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float mx = absmax_f32(x + 32 * b, 32);
        d[b] = mx / 127.0f;
        quantize_32_i8(x + 32 * b, _mm256_set1_ps(mx == 0.0f ? 0.0f : 127.0f / mx), q + 32 * b);
    }
}

static inline __m256i bytes_from_bits_32(const uint8_t *x) {
    uint32_t x32;
    memcpy(&x32, x, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* 32 signed int8 weights of one block */
static inline __m256i q32_weights(int type, const uint8_t *blk) {
    if (type == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 6));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    const __m256i hi = _mm256_andnot_si256(bytes_from_bits_32(blk + 2), _mm256_set1_epi8((char)0xF0));
    return _mm256_or_si256(v, hi); /* q5 - 16 */
}

#define Q32_Q8_ROWS(R)                                                                                     \
    static void q32_q8_rows_##R(int type, int bb, const uint8_t *wr, int64_t nb, const int8_t *q8,            \
                                const float *d8, int64_t K, float *out) {                                    \
        __m256 tot[R];                                                                                       \
        for (int r = 0; r < R; r++) tot[r] = _mm256_setzero_ps();                                            \
        const __m256i ones = _mm256_set1_epi16(1);                                                           \
        for (int64_t b = 0; b < nb; b++) {                                                                   \
            const uint8_t *blk = wr + b * bb;                                                                \
            const float d = f16(blk);                                                                        \
            const __m256i w = q32_weights(type, blk);                                                        \
            const __m256i aw = _mm256_sign_epi8(w, w);                                                       \
            for (int r = 0; r < R; r++) {                                                                    \
                const __m256i x = _mm256_loadu_si256((const __m256i *)(q8 + r * K + 32 * b));               \
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones); \
                tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * d8[r * (K / 32) + b]), tot[r]); \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) out[r] = hsum(tot[r]);                                                   \
    }
Q32_Q8_ROWS(1)
Q32_Q8_ROWS(2)
Q32_Q8_ROWS(4)

#ifndef DYNTREE_NO_VNNI
/* ggml_vnni.c: the same row kernels on AVX-512 VNNI, bit-identical results */
int dyntree_vnni_supported(void);
void dyntree_q4k_q8_rows_vnni(int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                              const int16_t *bs, int64_t K, float *out);
void dyntree_q6k_q8_rows_vnni(int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                              const int16_t *bs, int64_t K, float *out);
void dyntree_q5_0_q8_rows_vnni(int R, const uint8_t *wr, int64_t nb, const int8_t *q8, const float *d8,
                               const int32_t *corr, int64_t K, float *out);
#endif

/* out[i] = -16 x the sum of q[group * i .. group * i + group) for the n / group groups: the offset of the Q5_0
 * kernels' unsigned quants (q - 16), per int32 lane of the VNNI row kernel (group 4) or per block of the x8 tiles
 * (group 32) */
static void q5_0_offsets(const int8_t *q, int64_t n, int group, int32_t *out) {
    for (int64_t i = 0; i < n / group; i++) {
        int32_t sum = 0;
        for (int j = 0; j < group; j++) sum += q[group * i + j];
        out[i] = -16 * sum;
    }
}

/* products that took the VNNI row kernels since load (tests see which path ran) */
static int64_t vnni_products;

int64_t dyntree_ggml_vnni_products(void) { return __atomic_load_n(&vnni_products, __ATOMIC_RELAXED); }

/* 1 when this build has the AVX-512 VNNI row kernels and the CPU runs them */
int dyntree_ggml_vnni(void) {
#ifdef DYNTREE_NO_VNNI
    return 0;
#else
    return dyntree_vnni_supported();
#endif
}

/* y [M, N] = x [M, K] @ W^T (+ bias) with x quantized to int8 per 256 values (Q4_K, Q6_K weights) or per 32
 * (Q5_0, Q8_0). From vnni_min_rows rows on (0: never) Q4_K, Q6_K and Q5_0 run the AVX-512 VNNI row kernels where the
 * CPU has them (dyntree_ggml_vnni): the same outputs, bit for bit. T_Q4_K_X8 / T_Q6_K_X8 weights go to the x8 tiles. */
int dyntree_ggml_matmul_q8v(int type, const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y,
                            int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t vnni_min_rows) {
    const int x8 = type == T_Q4_K_X8 || type == T_Q6_K_X8 || type == T_Q5_0_X8; /* from here on `type` names the
                                                                                 * blocks' GGML type */
    if (x8) {
        type = type == T_Q4_K_X8 ? T_Q4_K : type == T_Q6_K_X8 ? T_Q6_K : T_Q5_0;
        if (N % 8) return -1;
    }
    int be, bb;
    const int kq = type == T_Q4_K || type == T_Q6_K; /* activations per 256 (Q8_K), else per 32 (Q8_0) */
    if (block_info(type, &be, &bb) || K % (kq ? 256 : 32)) return -1;
    const int64_t nb = K / be, row_bytes = nb * bb, nd = kq ? K / 256 : K / 32;
    int8_t *q8 = (int8_t *)aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64 + 64));
    float *d8 = (float *)malloc((size_t)(M * nd) * sizeof(float));
    int16_t *bs = (int16_t *)malloc((size_t)(M * (K / 16)) * sizeof(int16_t));
    if (!q8 || !d8 || !bs) {
        free(q8);
        free(d8);
        free(bs);
        return -2;
    }
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        if (kq) quantize_row_q8k(x + m * ldx, K, q8 + m * K, d8 + m * nd, bs + m * (K / 16));
        else quantize_row_q8_0(x + m * ldx, K, q8 + m * K, d8 + m * nd);
    }
    if (type == T_Q4_K) /* Q4_K's sub-blocks are 32 values: the sums per 16 paired, in place */
        for (int64_t i = 0; i < M * (K / 32); i++) bs[i] = (int16_t)(bs[2 * i] + bs[2 * i + 1]);
    const int64_t ldb = type == T_Q4_K ? K / 32 : K / 16;
#ifdef DYNTREE_NO_VNNI
    const int vnni = 0;
    (void)vnni_min_rows;
#else
    const int vnni = type != T_Q8_0 && vnni_min_rows > 0 && M >= vnni_min_rows && dyntree_vnni_supported();
    if (vnni) __atomic_fetch_add(&vnni_products, 1, __ATOMIC_RELAXED);
#endif
    if (x8 && type == T_Q5_0) { /* the tiles start each block's sums from -16 x its activations' sum */
        int32_t *bsum = (int32_t *)malloc((size_t)(M * nd) * sizeof(int32_t));
        if (!bsum) {
            free(q8);
            free(d8);
            free(bs);
            return -2;
        }
        q5_0_offsets(q8, M * K, 32, bsum);
        q5_0_x8_products(w, q8, d8, bsum, bias, y, ldy, M, N, K, vnni);
        free(bsum);
        free(q8);
        free(d8);
        free(bs);
        return 0;
    }
    int32_t *corr = NULL; /* [M, K / 4]: the VNNI Q5_0 kernel's lane offsets */
    if (vnni && !kq) {
        corr = (int32_t *)malloc((size_t)(M * (K / 4)) * sizeof(int32_t));
        if (!corr) {
            free(q8);
            free(d8);
            free(bs);
            return -2;
        }
        q5_0_offsets(q8, M * K, 4, corr);
    }
    if (x8) {
        x8_products(type, w, q8, d8, bs, ldb, bias, y, ldy, M, N, K, vnni);
        free(q8);
        free(d8);
        free(bs);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = w + n * row_bytes;
        const float bn = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M;) {
            const int64_t left = M - m0;
            /* Q4_K unpacks a block once for 8 rows (its 8 accumulator pairs spill, but the unpacking costs more;
             * Q6_K's did not gain); 3 rows take one pass of the K-quants, not 2 + 1 (a 3-node tree cost more
             * than a 4-node one) */
            const int R = type == T_Q4_K ? (left >= 8 ? 8 : (int)left) : left >= 4 ? 4 : (left == 3 && kq) ? 3 : (left >= 2 ? 2 : 1);
            float out[8];
            const int8_t *qm = q8 + m0 * K;
            const float *dm = d8 + m0 * nd;
            const int16_t *bm = bs + m0 * ldb;
            if (vnni) {
#ifndef DYNTREE_NO_VNNI
                if (!kq) dyntree_q5_0_q8_rows_vnni(R, wr, nb, qm, dm, corr + m0 * (K / 4), K, out);
                else (type == T_Q4_K ? dyntree_q4k_q8_rows_vnni : dyntree_q6k_q8_rows_vnni)(R, wr, nb, qm, dm, bm, K, out);
#endif
            } else if (!kq) {
                if (R == 4) q32_q8_rows_4(type, bb, wr, nb, qm, dm, K, out);
                else if (R == 2) q32_q8_rows_2(type, bb, wr, nb, qm, dm, K, out);
                else q32_q8_rows_1(type, bb, wr, nb, qm, dm, K, out);
            } else if (type == T_Q4_K) {
                if (R == 8) q4k_q8_rows_8(wr, nb, qm, dm, bm, K, out);
                else if (R == 7) q4k_q8_rows_7(wr, nb, qm, dm, bm, K, out);
                else if (R == 6) q4k_q8_rows_6(wr, nb, qm, dm, bm, K, out);
                else if (R == 5) q4k_q8_rows_5(wr, nb, qm, dm, bm, K, out);
                else if (R == 4) q4k_q8_rows_4(wr, nb, qm, dm, bm, K, out);
                else if (R == 3) q4k_q8_rows_3(wr, nb, qm, dm, bm, K, out);
                else if (R == 2) q4k_q8_rows_2(wr, nb, qm, dm, bm, K, out);
                else q4k_q8_rows_1(wr, nb, qm, dm, bm, K, out);
            } else {
                if (R == 4) q6k_q8_rows_4(wr, nb, qm, dm, bm, K, out);
                else if (R == 3) q6k_q8_rows_3(wr, nb, qm, dm, bm, K, out);
                else if (R == 2) q6k_q8_rows_2(wr, nb, qm, dm, bm, K, out);
                else q6k_q8_rows_1(wr, nb, qm, dm, bm, K, out);
            }
            for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n] = out[r] + bn;
            m0 += R;
        }
    }
    free(corr);
    free(q8);
    free(d8);
    free(bs);
    return 0;
}

int dyntree_ggml_matmul_q8(int type, const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y,
                           int64_t ldy, int64_t M, int64_t N, int64_t K) {
    return dyntree_ggml_matmul_q8v(type, x, ldx, w, bias, y, ldy, M, N, K, 0);
}

/* ---------------------------------------------------------------------------------------------------------
 * Q4_K rows repacked 8 at a time ("Q4_K x8", llama.cpp's REPACK idea in our own layout): a tile of 8 weight rows
 * (output columns) x R activation rows, one output column per 32-bit lane. Where the row kernels multiply one
 * weight row by 32 activations per instruction and reduce 8 lanes per block, here 4 activation bytes broadcast
 * to every lane meet 4 weights of each of the 8 columns; a sub-block's 8 vpmaddubsw are summed in int16 (8 x
 * 2 x 15 x 127 < 2^15) before one vpmaddwd by the 8 columns' scales: 9 multiplies per 256 products and row
 * where the row kernels issue 16, and no unpacking of 6-bit scales in the loop (stored as bytes).
 *
 * Arithmetic (one for every M, so a tree's rows get plain decoding's numbers): per block b, with the integer
 * sums I_b = sum_j sc_j * sum(q x)_j and N_b = sum_j m_j * sum(x8)_j (exact), the output accumulates
 * acc = fma(float(I_b), d_b * dx_b, acc); acc = fma(-float(N_b), dmin_b * dx_b, acc) in block order from 0;
 * then y = acc + bias. tests/test_x8_tiles.py holds it against a numpy model of exactly this.
 *
 * Layout per group of 8 rows and block (Q4K_X8_BYTES = 1184 bytes, in block order, groups in row order):
 *   d[8], dmin[8]  fp16                                   (32 bytes)
 *   sc[8 sub][8 col]     u8                               (64)
 *   mn[4 pair][8 col][2] u8, mins of sub 2p and 2p+1      (64: one vpmovzxbw gives vpmaddwd's operand)
 *   qs[8 sub][4 l][32]  byte 4c + t: low nibble q[c][32 sub + 4 l + t], high nibble q[c][32 sub + 4 (l + 4) + t]
 * 1184 bytes against the file's 8 x 144 = 1152 (the 6-bit scales and mins as bytes); a one-row product streams
 * every byte from DRAM, so the layout's size is its one-row time (with the scales stored twice, 1248 bytes, a
 * product at one row took 5% longer: docs/CPU_KERNELS.md). Packing them to the file's 6 bits would save 2.7% more
 * and cost unpacking instructions per sub-block in every tile.
 * --------------------------------------------------------------------------------------------------------- */
/* rows [N, K] of Q4_K blocks -> the x8 layout (N % 8 == 0); returns 0, or -1 on a shape it does not take */
int dyntree_q4k_x8_repack(const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    if (N % 8 || K % 256) return -1;
    const int64_t nb = K / 256;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * Q4K_X8_BYTES;
            for (int c = 0; c < 8; c++) {
                const uint8_t *blk = w + ((g * 8 + c) * nb + b) * 144;
                memcpy(o + 2 * c, blk, 2);
                memcpy(o + 16 + 2 * c, blk + 2, 2);
                int sc[8], mn[8];
                for (int j = 0; j < 8; j++) scale_min_k4(j, blk + 4, &sc[j], &mn[j]);
                for (int j = 0; j < 8; j++) o[Q4K_X8_SC + 8 * j + c] = (uint8_t)sc[j];
                for (int p = 0; p < 4; p++) {
                    o[Q4K_X8_MN + 16 * p + 2 * c] = (uint8_t)mn[2 * p];
                    o[Q4K_X8_MN + 16 * p + 2 * c + 1] = (uint8_t)mn[2 * p + 1];
                }
                uint8_t q[256];
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 32; i++) {
                        q[64 * j + i] = blk[16 + 32 * j + i] & 0x0F;
                        q[64 * j + 32 + i] = blk[16 + 32 * j + i] >> 4;
                    }
                for (int j = 0; j < 8; j++)
                    for (int l = 0; l < 4; l++)
                        for (int t = 0; t < 4; t++)
                            o[Q4K_X8_QS + 128 * j + 32 * l + 4 * c + t] =
                                (uint8_t)(q[32 * j + 4 * l + t] | (q[32 * j + 4 * (l + 4) + t] << 4));
            }
        }
    return 0;
}

/* the x8 layout back to GGML rows (dequantization, checks and the packed cache read those; one group of 8 rows
 * per thread at a time, as the repack) */
int dyntree_q4k_x8_unpack(const uint8_t *x8, int64_t N, int64_t K, uint8_t *w) {
    if (N % 8 || K % 256) return -1;
    const int64_t nb = K / 256;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = x8 + (g * nb + b) * Q4K_X8_BYTES;
            for (int c = 0; c < 8; c++) {
                uint8_t *blk = w + ((g * 8 + c) * nb + b) * 144;
                memcpy(blk, o + 2 * c, 2);
                memcpy(blk + 2, o + 16 + 2 * c, 2);
                int sc[8], mn[8];
                for (int j = 0; j < 8; j++) sc[j] = o[Q4K_X8_SC + 8 * j + c];
                for (int p = 0; p < 4; p++) {
                    mn[2 * p] = o[Q4K_X8_MN + 16 * p + 2 * c];
                    mn[2 * p + 1] = o[Q4K_X8_MN + 16 * p + 2 * c + 1];
                }
                uint8_t *s = blk + 4;
                for (int j = 0; j < 4; j++) {
                    s[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
                    s[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
                    s[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
                }
                uint8_t q[256];
                for (int j = 0; j < 8; j++)
                    for (int l = 0; l < 4; l++)
                        for (int t = 0; t < 4; t++) {
                            const uint8_t v = o[Q4K_X8_QS + 128 * j + 32 * l + 4 * c + t];
                            q[32 * j + 4 * l + t] = v & 0x0F;
                            q[32 * j + 4 * (l + 4) + t] = v >> 4;
                        }
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 32; i++)
                        blk[16 + 32 * j + i] = (uint8_t)(q[64 * j + i] | (q[64 * j + 32 + i] << 4));
            }
        }
    return 0;
}


/* one group of 8 weight rows (output columns) against R activation rows: acc[r] gets row r's 8 columns */
ROWS_KERNEL void q4k_x8_tile(const int R, const uint8_t *wg, int64_t nb, const int8_t *q8, const float *d8,
                             const int16_t *b32, int64_t K, __m256 *acc) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * Q4K_X8_BYTES;
        __m256i isum[X8_ROWS];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i p16[X8_ROWS];
            x8_prefetch(o, Q4K_X8_BYTES, j, 8);
            for (int l = 0; l < 4; l++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(o + Q4K_X8_QS + 128 * j + 32 * l));
                const __m256i lo = _mm256_and_si256(bytes, mask);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
                for (int r = 0; r < R; r++) {
                    const int8_t *x = q8 + r * K + b * 256 + 32 * j + 4 * l;
                    const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast_i32(x)),
                                                       _mm256_maddubs_epi16(hi, bcast_i32(x + 16)));
                    p16[r] = l ? _mm256_add_epi16(p16[r], t) : t;
                }
            }
            const __m128i s8 = _mm_loadl_epi64((const __m128i *)(o + Q4K_X8_SC + 8 * j));
            const __m256i s16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8));  /* each scale twice */
            for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], s16));
        }
        q4k_x8_block_floats(R, o, isum, b, d8, b32, K, acc);
    }
}

#define X8_TILE(R)                                                                                            \
    static void q4k_x8_tile_##R(const uint8_t *wg, int64_t nb, const int8_t *q8, const float *d8,            \
                                const int16_t *b32, int64_t K, __m256 *acc) {                                \
        q4k_x8_tile(R, wg, nb, q8, d8, b32, K, acc);                                                          \
    }
X8_TILE(1)
X8_TILE(2)
X8_TILE(3)
X8_TILE(4)

/* ---------------------------------------------------------------------------------------------------------
 * Q6_K rows repacked 8 at a time ("Q6_K x8"), the Q4_K x8 tiles' scheme for 6-bit weights: 16 values share a
 * signed scale, and two vpmaddubsw (63 x 127 x 2 each) fit an int16 lane, so a sub-block of 16 values takes 4
 * vpmaddubsw, 2 int16 adds and 2 vpmaddwd by the 8 columns' scales per activation row.
 *
 * Arithmetic (every M): per block b, I_b = sum_s sc_s * (sum_{v in s} q_v x_v - 32 * sum_{v in s} x_v) (exact),
 * acc = fma(float(I_b), d_b * dx_b, acc) in block order from 0; y = acc + bias.
 *
 * Layout per group of 8 rows and block (Q6K_X8_BYTES = 1680 = 8 x 210 bytes):
 *   d[8] fp16 (16 bytes); sc[16 sub][8 col] int8 (128);
 *   ql[16 sub][2 L][32]: byte 4c + e: low nibble = low 4 bits of q[c][16 sub + 4 L + e], high nibble those of
 *                        q[c][16 sub + 4 (L + 2) + e];
 *   qh[16 sub][32]: byte 4c + e, bits 2t, 2t+1 = top 2 bits of q[c][16 sub + 4 t + e] (t = 0..3)
 * --------------------------------------------------------------------------------------------------------- */

/* the 6-bit quant (0..63) of value v of a GGML Q6_K block */
static inline int q6k_value(const uint8_t *blk, int v) {
    const int h = v / 128, w = v % 128, g = w / 32, i = w % 32;
    const int low = (blk[64 * h + 32 * (g & 1) + i] >> (4 * (g >> 1))) & 0xF;
    return low | (((blk[128 + 32 * h + i] >> (2 * g)) & 3) << 4);
}

int dyntree_q6k_x8_repack(const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    if (N % 8 || K % 256) return -1;
    const int64_t nb = K / 256;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * Q6K_X8_BYTES;
            memset(o, 0, Q6K_X8_BYTES);
            for (int c = 0; c < 8; c++) {
                const uint8_t *blk = w + ((g * 8 + c) * nb + b) * 210;
                memcpy(o + 2 * c, blk + 208, 2);
                for (int s = 0; s < 16; s++) {
                    o[16 + 8 * s + c] = blk[192 + s];
                    for (int t = 0; t < 4; t++)
                        for (int e = 0; e < 4; e++) {
                            const int q = q6k_value(blk, 16 * s + 4 * t + e);
                            o[144 + 64 * s + 32 * (t & 1) + 4 * c + e] |= (uint8_t)((q & 0xF) << (4 * (t >> 1)));
                            o[144 + 1024 + 32 * s + 4 * c + e] |= (uint8_t)((q >> 4) << (2 * t));
                        }
                }
            }
        }
    return 0;
}

int dyntree_q6k_x8_unpack(const uint8_t *x8, int64_t N, int64_t K, uint8_t *w) {
    if (N % 8 || K % 256) return -1;
    const int64_t nb = K / 256;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = x8 + (g * nb + b) * Q6K_X8_BYTES;
            for (int c = 0; c < 8; c++) {
                uint8_t *blk = w + ((g * 8 + c) * nb + b) * 210;
                memset(blk, 0, 192);
                memcpy(blk + 208, o + 2 * c, 2);
                for (int s = 0; s < 16; s++) {
                    blk[192 + s] = o[16 + 8 * s + c];
                    for (int t = 0; t < 4; t++)
                        for (int e = 0; e < 4; e++) {
                            const int lo = (o[144 + 64 * s + 32 * (t & 1) + 4 * c + e] >> (4 * (t >> 1))) & 0xF;
                            const int hi = (o[144 + 1024 + 32 * s + 4 * c + e] >> (2 * t)) & 3;
                            const int v = 16 * s + 4 * t + e, h = v / 128, ww = v % 128, gg = ww / 32, i = ww % 32;
                            blk[64 * h + 32 * (gg & 1) + i] |= (uint8_t)(lo << (4 * (gg >> 1)));
                            blk[128 + 32 * h + i] |= (uint8_t)(hi << (2 * gg));
                        }
                }
            }
        }
    return 0;
}

/* one group of 8 Q6_K weight rows against R activation rows: acc[r] gets row r's 8 columns */
ROWS_KERNEL void q6k_x8_tile(const int R, const uint8_t *wg, int64_t nb, const int8_t *q8, const float *d8,
                             const int16_t *b16, int64_t K, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = wg + b * Q6K_X8_BYTES;
        __m256i isum[X8_ROWS];
        q6k_x8_offsets(R, o, b, b16, K, isum);
        for (int s = 0; s < 16; s++) {
            __m256i u[4];
            x8_prefetch(o, Q6K_X8_BYTES, s, 16);
            q6k_x8_quants(o, s, m4, m30, u);
            const __m256i s16 = q6k_x8_scales(o, s);
            for (int r = 0; r < R; r++) {
                const int8_t *x = q8 + r * K + b * 256 + 16 * s;
                const __m256i pa = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], bcast_i32(x)),
                                                    _mm256_maddubs_epi16(u[1], bcast_i32(x + 4)));
                const __m256i pb = _mm256_add_epi16(_mm256_maddubs_epi16(u[2], bcast_i32(x + 8)),
                                                    _mm256_maddubs_epi16(u[3], bcast_i32(x + 12)));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(pa, s16),
                                                                     _mm256_madd_epi16(pb, s16)));
            }
        }
        q6k_x8_block_floats(R, o, isum, b, d8, K, acc);
    }
}

#define X8_TILE6(R)                                                                                           \
    static void q6k_x8_tile_##R(const uint8_t *wg, int64_t nb, const int8_t *q8, const float *d8,            \
                                const int16_t *b16, int64_t K, __m256 *acc) {                                \
        q6k_x8_tile(R, wg, nb, q8, d8, b16, K, acc);                                                          \
    }
X8_TILE6(1)
X8_TILE6(2)
X8_TILE6(3)
X8_TILE6(4)

#ifndef DYNTREE_NO_VNNI
/* ggml_vnni.c: R = 1..X8_VNNI_ROWS rows against G = 1 or 2 groups (acc[r] group g, acc[X8_VNNI_ROWS + r] g+1) */
void dyntree_x8_tile_vnni(int q6k, int R, int G, const uint8_t *wg, int64_t gstride, int64_t nb, const int8_t *q8,
                          const float *d8, const int16_t *bs, int64_t K, __m256 *acc);
#endif

/* the x8 tiles' products (dyntree_ggml_matmul_q8v's x8 types, after its activation quantization): groups of 8
 * weight rows of a Q4_K or Q6_K weight in the x8 layout against up to X8_ROWS activation rows at a time; with VNNI
 * up to X8_VNNI_ROWS rows, and from X8_PAIR_MIN_ROWS rows on two groups per tile (16 columns on zmm) where two
 * are left */
static void x8_products(int type, const uint8_t *w, const int8_t *q8, const float *d8, const int16_t *bs,
                        int64_t ldb, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                        int vnni) {
    const int64_t nb = K / 256, groups = N / 8;
    const int64_t gstride = nb * (type == T_Q4_K ? Q4K_X8_BYTES : Q6K_X8_BYTES);
    const int64_t step = vnni && M >= X8_PAIR_MIN_ROWS ? 2 : 1, rows = vnni ? X8_VNNI_ROWS : X8_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < (groups + step - 1) / step; gi++) {
        const int64_t g = gi * step;
        const int G = groups - g >= step ? (int)step : 1;
        const uint8_t *wg = w + g * gstride;
        for (int64_t m0 = 0; m0 < M;) {
            const int R = M - m0 >= rows ? (int)rows : (int)(M - m0);
            __m256 acc[2 * X8_VNNI_ROWS];
            const int8_t *qm = q8 + m0 * K;
            const float *dm = d8 + m0 * nb;
            const int16_t *bm = bs + m0 * ldb;
            if (vnni) {
#ifndef DYNTREE_NO_VNNI
                dyntree_x8_tile_vnni(type == T_Q6_K, R, G, wg, gstride, nb, qm, dm, bm, K, acc);
#endif
            } else if (type == T_Q6_K) {
                if (R == 4) q6k_x8_tile_4(wg, nb, qm, dm, bm, K, acc);
                else if (R == 3) q6k_x8_tile_3(wg, nb, qm, dm, bm, K, acc);
                else if (R == 2) q6k_x8_tile_2(wg, nb, qm, dm, bm, K, acc);
                else q6k_x8_tile_1(wg, nb, qm, dm, bm, K, acc);
            } else if (R == 4) q4k_x8_tile_4(wg, nb, qm, dm, bm, K, acc);
            else if (R == 3) q4k_x8_tile_3(wg, nb, qm, dm, bm, K, acc);
            else if (R == 2) q4k_x8_tile_2(wg, nb, qm, dm, bm, K, acc);
            else q4k_x8_tile_1(wg, nb, qm, dm, bm, K, acc);
            for (int h = 0; h < G; h++) {
                const __m256 bv = bias ? _mm256_loadu_ps(bias + 8 * (g + h)) : _mm256_setzero_ps();
                for (int r = 0; r < R; r++)
                    _mm256_storeu_ps(y + (m0 + r) * ldy + 8 * (g + h), _mm256_add_ps(acc[h * X8_VNNI_ROWS + r], bv));
            }
            m0 += R;
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Q5_0 rows repacked 8 at a time ("Q5_0 x8", the draft's q/k/v/o and gate/up): a tile of 8 weight rows against R
 * activation rows, one output column per 32-bit lane, as Q4_K x8 does. Where the Q5_0 row kernel reduces 8 lanes per
 * row and adds one block after another into one float chain per row, here 8 columns run side by side: 4 activation
 * bytes broadcast to every lane meet 4 quants of each column (one vpmaddubsw + vpmaddwd, or one vpdpbusd).
 *
 * Arithmetic (the same for every M, so a tree's rows get plain decoding's numbers; its own, not the row kernel's:
 * outputs differ from it by float rounding): per block b the exact integers I_c = sum_k (q_ck - 16) x_k, then
 * acc_c = fma(float(I_c), d_c * dx_b, acc_c) in block order from 0; y = acc + bias (q5_0_x8.h;
 * tests/test_x8_tiles.py holds it against a numpy model of exactly this).
 *
 * Layout per group of 8 rows and block (Q5_0_X8_BYTES = 176 = 8 x 22 bytes, in block order, groups in row order):
 *   d[8]        fp16                                                     (16 bytes)
 *   qh[8 t][4]  32-bit masks: bit 4c + j of mask t = the fifth bit of column c's value 4t + j   (32)
 *   qs[4 l][32] byte 4c + j = column c's GGUF qs byte 4l + j: low nibble value 4l + j, high nibble 16 + 4l + j (128)
 * --------------------------------------------------------------------------------------------------------- */
int dyntree_q5_0_x8_repack(const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    if (N % 8 || K % 32) return -1;
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * Q5_0_X8_BYTES;
            memset(o + 16, 0, 32);
            for (int c = 0; c < 8; c++) {
                const uint8_t *blk = w + ((g * 8 + c) * nb + b) * 22;
                uint32_t qh;
                memcpy(o + 2 * c, blk, 2);
                memcpy(&qh, blk + 2, 4);
                for (int t = 0; t < 8; t++)
                    for (int j = 0; j < 4; j++)
                        if ((qh >> (4 * t + j)) & 1) o[16 + 4 * t + c / 2] |= (uint8_t)(1u << (4 * (c & 1) + j));
                for (int l = 0; l < 4; l++) memcpy(o + 48 + 32 * l + 4 * c, blk + 6 + 4 * l, 4);
            }
        }
    return 0;
}

int dyntree_q5_0_x8_unpack(const uint8_t *x8, int64_t N, int64_t K, uint8_t *w) {
    if (N % 8 || K % 32) return -1;
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = x8 + (g * nb + b) * Q5_0_X8_BYTES;
            for (int c = 0; c < 8; c++) {
                uint8_t *blk = w + ((g * 8 + c) * nb + b) * 22;
                uint32_t qh = 0;
                memcpy(blk, o + 2 * c, 2);
                for (int t = 0; t < 8; t++)
                    for (int j = 0; j < 4; j++)
                        if ((o[16 + 4 * t + c / 2] >> (4 * (c & 1) + j)) & 1) qh |= 1u << (4 * t + j);
                memcpy(blk + 2, &qh, 4);
                for (int l = 0; l < 4; l++) memcpy(blk + 6 + 4 * l, o + 48 + 32 * l + 4 * c, 4);
            }
        }
    return 0;
}

/* AVX2: 4 signed activation bytes at x (broadcast) times the unsigned quants, pairs summed in int16 (at most
 * 2 x 31 x 127), then in int32 */
static inline __attribute__((always_inline)) __m256i q50x8_dpbusd_avx2(__m256i acc, __m256i w, const int8_t *x) {
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, bcast_i32(x)), _mm256_set1_epi16(1));
    return _mm256_add_epi32(acc, p);
}

static inline __attribute__((always_inline)) __m256i q50x8_add16_avx2(__m256i v, uint32_t bits) {
    return _mm256_add_epi8(v, _mm256_and_si256(bytes_from_bits_32((const uint8_t *)&bits), _mm256_set1_epi8(16)));
}

#define Q50X8_NAME q5_0_x8_tile
#define Q50X8_DPBUSD q50x8_dpbusd_avx2
#define Q50X8_ADD16 q50x8_add16_avx2
#include "q5_0_x8.h"
#undef Q50X8_NAME
#undef Q50X8_DPBUSD
#undef Q50X8_ADD16

#ifndef DYNTREE_NO_VNNI
/* ggml_vnni.c: the same tile on AVX-512 VNNI, R = 1..X8_VNNI_ROWS */
void dyntree_q5_0_x8_tile_vnni(int R, const uint8_t *wg, int64_t nb, const int8_t *q8, const float *d8,
                               const int32_t *bsum, int64_t K, __m256 *acc);
#endif

/* dyntree_ggml_matmul_q8v's Q5_0 x8 products: groups of 8 weight rows against up to X8_ROWS activation rows at a
 * time (X8_VNNI_ROWS with VNNI); bsum [M, K / 32]: -16 x each block's activation sum */
static void q5_0_x8_products(const uint8_t *w, const int8_t *q8, const float *d8, const int32_t *bsum,
                             const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int vnni) {
    const int64_t nb = K / 32, gstride = nb * Q5_0_X8_BYTES, rows = vnni ? X8_VNNI_ROWS : X8_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / 8; g++) {
        const uint8_t *wg = w + g * gstride;
        for (int64_t m0 = 0; m0 < M;) {
            const int R = M - m0 >= rows ? (int)rows : (int)(M - m0);
            __m256 acc[X8_VNNI_ROWS];
            const int8_t *qm = q8 + m0 * K;
            const float *dm = d8 + m0 * nb;
            const int32_t *sm = bsum + m0 * nb;
            if (vnni) {
#ifndef DYNTREE_NO_VNNI
                dyntree_q5_0_x8_tile_vnni(R, wg, nb, qm, dm, sm, K, acc);
#endif
            } else if (R == 4) q5_0_x8_tile(4, wg, nb, qm, dm, sm, K, acc);
            else if (R == 3) q5_0_x8_tile(3, wg, nb, qm, dm, sm, K, acc);
            else if (R == 2) q5_0_x8_tile(2, wg, nb, qm, dm, sm, K, acc);
            else q5_0_x8_tile(1, wg, nb, qm, dm, sm, K, acc);
            const __m256 bv = bias ? _mm256_loadu_ps(bias + 8 * g) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (m0 + r) * ldy + 8 * g, _mm256_add_ps(acc[r], bv));
            m0 += R;
        }
    }
}
