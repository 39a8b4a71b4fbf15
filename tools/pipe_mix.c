/* Which vector instructions take issue slots from 512-bit VPDPBUSD (AVX512-VNNI): 8 independent VPDPBUSD chains
   per loop step, alone and beside a few other instructions of the integer tiles' chain (quant.h), each on its own
   registers, so that nothing waits on anything; nanoseconds per step. An instruction that adds time shares the
   dot products' execution units: the float work a tile does per row and 32 inputs is paid out of the dot products'
   own throughput, which bounds a tile below the VPDPBUSD peak whatever its schedule.

   Build and run: gcc -O2 tools/pipe_mix.c -o /tmp/pipe_mix && /tmp/pipe_mix   (needs AVX512-VNNI) */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define STEPS 20000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define DP(c) __asm__ volatile("vpdpbusd %1, %1, %0" : "+v"(c) : "v"(a))
#define DP8 DP(c0); DP(c1); DP(c2); DP(c3); DP(c4); DP(c5); DP(c6); DP(c7)
#define OP(ins, out) __asm__ volatile(ins : "=v"(out) : "v"(a), "v"(f))

/* One variant: 8 VPDPBUSD and `count` of instruction `ins` (AT&T, %1: an integer vector, %2: a float one). */
#define VARIANT(label, ins, count)                                                                                 \
    do {                                                                                                           \
        double t = now();                                                                                          \
        for (long i = 0; i < STEPS; i++) {                                                                         \
            DP8;                                                                                                   \
            if ((count) > 0) OP(ins, o0);                                                                          \
            if ((count) > 1) OP(ins, o1);                                                                          \
            if ((count) > 2) OP(ins, o2);                                                                          \
            if ((count) > 3) OP(ins, o3);                                                                          \
        }                                                                                                          \
        printf("8 vpdpbusd + %d %-34s %.2f ns\n", (count), label, (now() - t) / STEPS * 1e9);                      \
    } while (0)

__attribute__((target("avx512f,avx512vnni"))) int main(void) {
    __m512i a = _mm512_set1_epi8(1), c0 = a, c1 = a, c2 = a, c3 = a, c4 = a, c5 = a, c6 = a, c7 = a, o0, o1, o2, o3;
    __m512 f = _mm512_set1_ps(1.0f);
    /* The first: a loop of the dot products beside instructions known not to share their units. */
    VARIANT("vpaddd (integer add)", "vpaddd %1, %1, %0", 4);
    VARIANT("vcvtdq2ps (int32 -> float)", "vcvtdq2ps %1, %0", 2);
    VARIANT("vaddps (float add)", "vaddps %2, %2, %0", 2);
    VARIANT("vmulps (float multiply)", "vmulps %2, %2, %0", 1);
    VARIANT("vfmadd231ps (float fma)", "vfmadd231ps %2, %2, %0", 3);
    VARIANT("vpmulld (int32 multiply)", "vpmulld %1, %1, %0", 1);
    VARIANT("vpslld (shift)", "vpslld $3, %1, %0", 2);
    VARIANT("vpandd (and)", "vpandd %1, %1, %0", 4);
    VARIANT("vpaddd again", "vpaddd %1, %1, %0", 4);
    return (int)_mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c7), o0)) == 7;
}
