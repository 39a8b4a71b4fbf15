/* This CPU's multiply-add peaks per instruction family, on 1 thread and on all: the roofline the integer tiles are
   measured against (tools/measure_tiles.py builds and runs it).

   Each family runs 12 accumulators, each its own chain, through `asm volatile`: the compiler can neither merge
   chains that compute the same values (with plain intrinsics on constant operands gcc -O2 folds 8 identical
   chains into one, and a count of 8 operations per loop then overstates the peak by the chain's latency ratio)
   nor drop chains whose results are unused. The inputs stay in registers: the rate of the instruction itself.
   A "MAC" is one multiply-add of the family's element type (int8 pairs for the int8 ones). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>

#define ITERS 20000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* One loop step of 12 independent chains of instruction `ins` (AT&T operand order: sources, then the
   accumulator), on vector registers of constraint `reg`. */
#define CHAINS12(ins, reg, a, b)                                                                                  \
    __asm__ volatile(ins " %13, %12, %0\n\t" ins " %13, %12, %1\n\t" ins " %13, %12, %2\n\t" ins " %13, %12, %3\n\t" \
                     ins " %13, %12, %4\n\t" ins " %13, %12, %5\n\t" ins " %13, %12, %6\n\t" ins " %13, %12, %7\n\t" \
                     ins " %13, %12, %8\n\t" ins " %13, %12, %9\n\t" ins " %13, %12, %10\n\t" ins " %13, %12, %11"   \
                     : "+" reg(c0), "+" reg(c1), "+" reg(c2), "+" reg(c3), "+" reg(c4), "+" reg(c5), "+" reg(c6),    \
                       "+" reg(c7), "+" reg(c8), "+" reg(c9), "+" reg(c10), "+" reg(c11)                            \
                     : reg(a), reg(b))

#define FAMILY(name, isa, type, ins, reg, macs)                                                                \
    __attribute__((target(isa))) static double name(void) {                                                      \
        type a = {0}, b = {0}, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11;                                  \
        c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = a;                                          \
        for (long i = 0; i < ITERS; i++) CHAINS12(ins, reg, a, b);                                               \
        return 12.0 * (macs) * ITERS;                                                                             \
    }

FAMILY(fma256, "avx2,fma", __m256, "vfmadd231ps", "x", 8)
FAMILY(fma512, "avx512f", __m512, "vfmadd231ps", "v", 16)
FAMILY(vnni256_vex, "avx2,avxvnni", __m256i, "%{vex%} vpdpbusd", "x", 32)
FAMILY(vnni256_evex, "avx512f,avx512vl,avx512vnni", __m256i, "vpdpbusd", "v", 32)
FAMILY(vnni512, "avx512f,avx512vnni", __m512i, "vpdpbusd", "v", 64)
FAMILY(bf16dot512, "avx512f,avx512bf16", __m512, "vdpbf16ps", "v", 32)
/* VPMADDUBSW alone (16-bit pair sums, not accumulated): the ceiling of tiles that widen a run of them once. */
FAMILY(pairs256, "avx2", __m256i, "vpmaddubsw", "x", 32)

/* AVX2's int8 product (vpmaddubsw, vpmaddwd, then vpaddd into the chain): three instructions per 32 MACs. */
__attribute__((target("avx2"))) static double maddubs256(void) {
    __m256i a = {0}, b = {0}, one = {0}, t, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11;
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = a;
#define STEP(c)                                                                                                    \
    __asm__ volatile("vpmaddubsw %3, %2, %0\n\tvpmaddwd %4, %0, %0\n\tvpaddd %0, %1, %1"                          \
                     : "=&x"(t), "+x"(c)                                                                           \
                     : "x"(a), "x"(b), "x"(one))
    for (long i = 0; i < ITERS; i++) {
        STEP(c0); STEP(c1); STEP(c2); STEP(c3); STEP(c4); STEP(c5);
        STEP(c6); STEP(c7); STEP(c8); STEP(c9); STEP(c10); STEP(c11);
    }
#undef STEP
    return 12.0 * 32 * ITERS;
}

static void bench(const char *name, int supported, double (*fn)(void)) {
    if (!supported) {
        printf("%-40s not on this CPU\n", name);
        return;
    }
    const int all = omp_get_max_threads();
    for (int th = 1; th <= all; th = th == all ? all + 1 : all) {
        double macs = 0, t = now();
#pragma omp parallel num_threads(th) reduction(+ : macs)
        macs += fn();
        printf("%-40s %2d thread(s): %7.1f G MAC/s\n", name, th, macs / (now() - t) / 1e9);
    }
}

int main(void) {
    __builtin_cpu_init();
    bench("fp32 FMA, 256-bit (AVX2)", __builtin_cpu_supports("fma"), fma256);
    bench("int8 maddubs+madd, 256-bit (AVX2)", __builtin_cpu_supports("avx2"), maddubs256);
    bench("int8 vpmaddubsw alone, 256-bit (AVX2)", __builtin_cpu_supports("avx2"), pairs256);
    bench("int8 vpdpbusd, 256-bit (AVX-VNNI)", __builtin_cpu_supports("avxvnni"), vnni256_vex);
    bench("int8 vpdpbusd, 256-bit (AVX512-VNNI VL)", __builtin_cpu_supports("avx512vnni"), vnni256_evex);
    bench("fp32 FMA, 512-bit (AVX-512F)", __builtin_cpu_supports("avx512f"), fma512);
    bench("int8 vpdpbusd, 512-bit (AVX512-VNNI)", __builtin_cpu_supports("avx512vnni"), vnni512);
    bench("bf16 vdpbf16ps, 512-bit (AVX512-BF16)", __builtin_cpu_supports("avx512bf16"), bf16dot512);
    return 0;
}
