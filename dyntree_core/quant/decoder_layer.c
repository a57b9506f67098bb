/* One Qwen2/Llama decoder layer over n new positions, in C: the glue between the GGML block products
 * (ggml_kernels.c) that torch would run as ~35 small ops per layer.
 *
 *     h += o_proj(attention(rope(q_proj(n1(h))), rope(k_proj(n1(h))), v_proj(n1(h)), visible))
 *     h += down_proj(silu(gate(n2(h))) * up(n2(h)))
 *
 * Each row's result depends only on that row and on the keys/values it sees, in their cache order: the
 * products are the row kernels (rows independent), RMSNorm and rotary work per row, and attention sums each
 * query's softmax and values over the visible keys one key after another (a masked key adds exact zeros).
 * So a tree's accepted path gets bit-for-bit the numbers plain decoding gets for the same tokens.
 *
 * Rounding: RMSNorm and rotary round like transformers' float32 code (x * rsqrt(mean(x^2) + eps), then * w;
 * q*cos + rotate_half(q)*sin); exp is a degree-6 polynomial (Cephes expf, ~1 ulp); sums differ from torch's
 * in order only.
 *
 * Cache: keys/values [Hkv, cap, hd] float32 (the engine's PreallocLayer buffers, batch 1); the n new rows go
 * to slots [past, past + n).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "avx2_sum.h"

int dyntree_ggml_matmul(int type, const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y,
                        int64_t ldy, int64_t M, int64_t N, int64_t K);
int dyntree_ggml_matmul_q8v(int type, const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y,
                            int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t vnni_min_rows);

enum { P_Q, P_K, P_V, P_O, P_GATE_UP, P_DOWN, N_PROJ };

/* Mirrors quant/native_layer.py's LayerDesc field for field. */
typedef struct {
    int32_t type[N_PROJ];      /* GGML type ids of q, k, v, o, gate_up (gate rows then up rows), down */
    const uint8_t *w[N_PROJ];  /* their blocks, [N, K] GGML rows */
    const float *bias[N_PROJ]; /* float32 [N] or NULL */
    const float *norm1, *norm2; /* RMSNorm weights [hidden] */
    float eps;                  /* RMSNorm epsilon */
    float scale;                /* attention scale (1/sqrt(hd) unless the config says otherwise) */
    int32_t int8_act;           /* 1: int8 activations (dyntree_ggml_matmul_q8), 0: float32 */
    int32_t hidden, heads, kv_heads, head_dim, inter;
    int32_t vnni_rows[N_PROJ]; /* int8 products: AVX-512 VNNI row kernels from this many rows (0: never) */
} layer_desc;

/* e^x for 8 floats (Cephes expf: x = k ln2 + r, |r| <= ln2/2, degree-6 polynomial; x clamped to +-88.37) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^k, k in [-127, 128]: two factors so that k = -127 and 128 stay representable */
    const __m256i ki = _mm256_cvtps_epi32(k);
    const __m256i k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, _mm256_set1_epi32(127)), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

/* y = (x * rsqrt(mean(x^2) + eps)) * w, per row of d values (d a multiple of 8) */
static void rms_norm_row(const float *x, const float *w, float eps, int64_t d, float *y) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const float r = 1.0f / sqrtf(hsum(ss) / (float)d + eps);
    const __m256 vr = _mm256_set1_ps(r);
    for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vr), _mm256_loadu_ps(w + i)));
}

/* in place over nh heads of hd values: x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1] */
static void rope_row(float *x, int nh, int hd, const float *cos, const float *sin) {
    const int half = hd / 2;
    for (int h = 0; h < nh; h++) {
        float *v = x + (int64_t)h * hd;
        for (int i = 0; i < half; i += 8) {
            const __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + half + i);
            const __m256 lo = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cos + i)),
                                            _mm256_mul_ps(b, _mm256_loadu_ps(sin + i)));
            const __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cos + half + i)),
                                            _mm256_mul_ps(a, _mm256_loadu_ps(sin + half + i)));
            _mm256_storeu_ps(v + i, lo);
            _mm256_storeu_ps(v + half + i, hi);
        }
    }
}

/* One query head against keys [0, kv_len) of one kv head; vis[j] != 0 = may attend (vis NULL: all).
 * s: scratch of kv_len (+ 8) floats. out [hd]. */
static void attend(const float *q, const float *kb, const float *vb, int64_t kv_len, const uint8_t *vis, float scale,
                   int hd, float *s, float *out) {
    float m = -INFINITY;
    for (int64_t j = 0; j < kv_len; j++) {
        if (vis && !vis[j]) {
            s[j] = -INFINITY;
            continue;
        }
        const float *k = kb + j * hd;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), a1);
        }
        s[j] = hsum(_mm256_add_ps(a0, a1)) * scale;
        if (s[j] > m) m = s[j];
    }
    for (int i = 0; i < hd; i++) out[i] = 0.0f;
    if (m == -INFINITY) return; /* nothing visible (the engine never asks) */
    const int64_t j8 = kv_len & ~(int64_t)7;
    const __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < j8; j += 8) {
        const __m256 sj = _mm256_loadu_ps(s + j);
        _mm256_storeu_ps(s + j, _mm256_and_ps(exp8(_mm256_sub_ps(sj, vm)), _mm256_cmp_ps(sj, ninf, _CMP_NEQ_OQ)));
    }
    if (j8 < kv_len) {
        float t[8];
        for (int i = 0; i < 8; i++) t[i] = j8 + i < kv_len ? s[j8 + i] : -INFINITY;
        const __m256 sj = _mm256_loadu_ps(t);
        _mm256_storeu_ps(t, _mm256_and_ps(exp8(_mm256_sub_ps(sj, vm)), _mm256_cmp_ps(sj, ninf, _CMP_NEQ_OQ)));
        for (int64_t i = 0; j8 + i < kv_len; i++) s[j8 + i] = t[i];
    }
    float sum = 0.0f;
    __m256 acc[16]; /* hd <= 128 */
    const int nv = hd / 8;
    for (int i = 0; i < nv; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < kv_len; j++) {
        const float p = s[j];
        if (p == 0.0f) continue;
        sum += p;
        const __m256 vp = _mm256_set1_ps(p);
        const float *v = vb + j * hd;
        for (int i = 0; i < nv; i++) acc[i] = _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int i = 0; i < nv; i++) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

static int product(const layer_desc *L, int p, const float *x, int64_t n, int64_t N, int64_t K, float *y) {
    if (L->int8_act)
        return dyntree_ggml_matmul_q8v(L->type[p], x, K, L->w[p], L->bias[p], y, N, n, N, K, L->vnni_rows[p]);
    return dyntree_ggml_matmul(L->type[p], x, K, L->w[p], L->bias[p], y, N, n, N, K);
}

/* floats of ``work`` dyntree_decoder_layer needs for n new rows over kv_len keys */
int64_t dyntree_decoder_layer_work(const layer_desc *L, int64_t n, int64_t kv_len) {
    const int64_t D = L->hidden, Q = (int64_t)L->heads * L->head_dim, KV = (int64_t)L->kv_heads * L->head_dim;
    const int64_t I = L->inter;
    const int64_t per_row = D + Q + 2 * KV + Q + D + 2 * I + I;
    return n * per_row + (int64_t)omp_get_max_threads() * (kv_len + 8) + 64;
}

/* h [n, hidden] in place. cos, sin [n, head_dim]. kbuf, vbuf [kv_heads, cap, head_dim]; the new rows' keys and
 * values are written to slots [past, past + n). visible [n, past + n] (row stride ldvis; 1 = may attend) or
 * NULL (causal). work: dyntree_decoder_layer_work floats. Returns 0, or -1 (shape) / the product's error. */
int dyntree_decoder_layer(const layer_desc *L, float *h, int64_t n, const float *cos, const float *sin, float *kbuf,
                          float *vbuf, int64_t cap, int64_t past, const uint8_t *visible, int64_t ldvis, float *work,
                          int64_t work_len) {
    const int64_t D = L->hidden, hd = L->head_dim, H = L->heads, Hkv = L->kv_heads, I = L->inter;
    const int64_t Q = H * hd, KV = Hkv * hd, kv_len = past + n;
    if (hd % 16 || hd > 128 || D % 8 || I % 8 || H % Hkv || past + n > cap
        || work_len < dyntree_decoder_layer_work(L, n, kv_len))
        return -1;
    float *x = work, *q = x + n * D, *k = q + n * Q, *v = k + n * KV, *att = v + n * KV, *o = att + n * Q;
    float *gu = o + n * D, *act = gu + n * 2 * I, *scores = act + n * I;
    int rc;

    for (int64_t i = 0; i < n; i++) rms_norm_row(h + i * D, L->norm1, L->eps, D, x + i * D);
    if ((rc = product(L, P_Q, x, n, Q, D, q)) || (rc = product(L, P_K, x, n, KV, D, k))
        || (rc = product(L, P_V, x, n, KV, D, v)))
        return rc;
    for (int64_t i = 0; i < n; i++) {
        rope_row(q + i * Q, (int)H, (int)hd, cos + i * hd, sin + i * hd);
        rope_row(k + i * KV, (int)Hkv, (int)hd, cos + i * hd, sin + i * hd);
        for (int64_t g = 0; g < Hkv; g++) {
            memcpy(kbuf + (g * cap + past + i) * hd, k + i * KV + g * hd, (size_t)hd * sizeof(float));
            memcpy(vbuf + (g * cap + past + i) * hd, v + i * KV + g * hd, (size_t)hd * sizeof(float));
        }
    }
    const int64_t group = H / Hkv;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * H; task++) {
        const int64_t i = task / H, hh = task % H, g = hh / group;
        float *s = scores + (int64_t)omp_get_thread_num() * (kv_len + 8);
        const uint8_t *vis = visible ? visible + i * ldvis : NULL;
        /* causal without a mask: row i sees keys [0, past + i] */
        attend(q + i * Q + hh * hd, kbuf + g * cap * hd, vbuf + g * cap * hd, visible ? kv_len : past + i + 1, vis,
               L->scale, (int)hd, s, att + i * Q + hh * hd);
    }
    if ((rc = product(L, P_O, att, n, D, Q, o))) return rc;
    for (int64_t t = 0; t < n * D; t += 8)
        _mm256_storeu_ps(h + t, _mm256_add_ps(_mm256_loadu_ps(h + t), _mm256_loadu_ps(o + t)));

    for (int64_t i = 0; i < n; i++) rms_norm_row(h + i * D, L->norm2, L->eps, D, x + i * D);
    if ((rc = product(L, P_GATE_UP, x, n, 2 * I, D, gu))) return rc;
    const int64_t chunks = (n * I) / 8;
#pragma omp parallel for schedule(static) if (n * I >= 32768)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t i = (8 * c) / I, t = (8 * c) % I;
        const __m256 g = _mm256_loadu_ps(gu + i * 2 * I + t), u = _mm256_loadu_ps(gu + i * 2 * I + I + t);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(act + i * I + t, _mm256_mul_ps(silu, u));
    }
    if ((rc = product(L, P_DOWN, act, n, D, I, o))) return rc;
    for (int64_t t = 0; t < n * D; t += 8)
        _mm256_storeu_ps(h + t, _mm256_add_ps(_mm256_loadu_ps(h + t), _mm256_loadu_ps(o + t)));
    return 0;
}

/* n_layers decoder layers (L[0..n_layers)) over the same n rows in one call: dyntree_decoder_layer layer after
 * layer, the same numbers, with no Python between the layers (0.99x the per-layer calls' time for the 0.5B draft and
 * the 1.5B target, n = 1 and 4, alternated in one process on the Zen 4 host). kbufs, vbufs,
 * caps: each layer's cache buffers and their capacity; every layer holds `past` positions. On an error, *failed
 * is the layer that refused and its code is returned. */
int dyntree_decoder_layers(const layer_desc *L, int64_t n_layers, float *h, int64_t n, const float *cos,
                           const float *sin, float *const *kbufs, float *const *vbufs, const int64_t *caps,
                           int64_t past, const uint8_t *visible, int64_t ldvis, float *work, int64_t work_len,
                           int64_t *failed) {
    for (int64_t i = 0; i < n_layers; i++) {
        const int rc = dyntree_decoder_layer(L + i, h, n, cos, sin, kbufs[i], vbufs[i], caps[i], past, visible, ldvis,
                                             work, work_len);
        if (rc) {
            *failed = i;
            return rc;
        }
    }
    return 0;
}
