/* Throughput and latency of the AVX-512 VNNI instructions the x8 tiles issue, on this core (the ceiling the tiles
 * are measured against in docs/CPU_KERNELS.md). Assumes the clock it is told (measure it with `perf` or from a
 * dependent add chain: the first line printed).
 *
 *     cc -O2 scripts/vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak
 */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ITERS 100000000L
#define TIME(name, body, per_iter)                                                                           \
    do {                                                                                                     \
        double t = now();                                                                                    \
        for (long i = 0; i < ITERS; i++) __asm__ volatile(body ::"r"(mem) : "memory");                       \
        printf("%-44s %.2f cycles each\n", name, (now() - t) / (per_iter * (double)ITERS) * ghz * 1e9);      \
    } while (0)
#define X12(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11)
#define DPZ(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define DPY(i) "vpdpbusd %%ymm30, %%ymm31, %%ymm" #i "\n\t"
#define MULZ(i) "vpmulld %%zmm30, %%zmm" #i ", %%zmm" #i "\n\t"
#define DPM(i) "vpdpbusd " #i "*4(%0)%{1to16%}, %%zmm31, %%zmm" #i "\n\t"
#define DP8M DPM(0) DPM(1) DPM(2) DPM(3) DPM(4) DPM(5) DPM(6) DPM(7)

int main(void) {
    int mem[64] = {1};
    double t = now();
    long x = 0;
    for (long i = 0; i < ITERS; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    const double ghz = 4.0 * ITERS / (now() - t) / 1e9;
    printf("clock from a dependent add chain: %.2f GHz\n", ghz);
    TIME("vpdpbusd zmm, 12 independent chains", X12(DPZ), 12);
    TIME("vpdpbusd ymm, 12 independent chains", X12(DPY), 12);
    TIME("vpdpbusd zmm, one chain (latency)", DPZ(0) DPZ(0) DPZ(0) DPZ(0), 4);
    TIME("vpmulld zmm, 12 independent", X12(MULZ), 12);
    TIME("vpdpbusd zmm {1to16} memory broadcast, 8 ch", DP8M, 8);
    TIME("  + 1 vpmulld per 8 (per vpdpbusd)", DP8M "vpmulld %%zmm20, %%zmm21, %%zmm22\n\t", 8);
    return 0;
}
