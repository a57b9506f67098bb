/* Multiply-adds per cycle of one VNNI x8 tile call (ggml_vnni.c's dyntree_x8_tile_vnni) with its weights and
 * activations in L1/L2, one core: the tiles' compute rate apart from memory, against vpdpbusd's ceiling of 64 per
 * cycle (scripts/vnni_peak.c). Arguments: q6k (0: Q4_K, 1: Q6_K), R (rows, 1..8), K, G (groups, 1 or 2), GHz.
 *
 *     so=$(.venv/bin/python -c "from dyntree_core.quant import native; print(native.native_kernels().path)")
 *     cc -O2 -mavx2 scripts/x8_tile_rate.c "$so" -o /tmp/x8_tile_rate -Wl,-rpath,$(dirname "$so")
 *     for r in 1 4 8; do /tmp/x8_tile_rate 0 $r 1536 2 3.65; done
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void dyntree_x8_tile_vnni(int q6k, int R, int G, const uint8_t *wg, int64_t gstride, int64_t nb, const int8_t *q8,
                          const float *d8, const int16_t *bs, int64_t K, __m256 *acc);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s q6k R K G GHz\n", argv[0]);
        return 2;
    }
    const int q6k = atoi(argv[1]), R = atoi(argv[2]), G = atoi(argv[4]);
    const int64_t K = atoll(argv[3]), nb = K / 256, gstride = nb * (q6k ? 1680 : 1184);
    const double ghz = atof(argv[5]);
    uint8_t *w = aligned_alloc(64, 2 * gstride + 8192);
    for (int64_t i = 0; i < 2 * gstride + 8192; i++) w[i] = (uint8_t)((i * 37) & 0x3f);
    int8_t *q8 = aligned_alloc(64, R * K);
    for (int64_t i = 0; i < R * K; i++) q8[i] = (int8_t)((i * 13) % 200 - 100);
    float *d8 = calloc(R * nb, sizeof(float));
    int16_t *bs = calloc(R * K, sizeof(int16_t));
    __m256 acc[16];
    const long iters = 400000000L / (K * R);
    const double t = now();
    for (long i = 0; i < iters; i++) dyntree_x8_tile_vnni(q6k, R, G, w, gstride, nb, q8, d8, bs, K, acc);
    const double dt = now() - t, macs = (double)iters * 8 * G * K * R;
    printf("%s R=%d K=%lld G=%d: %.1f GMAC/s, %.1f per cycle at %.2f GHz\n", q6k ? "Q6_K" : "Q4_K", R, (long long)K, G,
           macs / dt / 1e9, macs / dt / (ghz * 1e9), ghz);
    return 0;
}
