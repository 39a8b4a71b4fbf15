/* The integer step of quant.h's integer products, 8 lanes at a time: q_dot4(acc, a, b) gives lane j of acc plus
   sum_{i=4j..4j+3} a_i * b_i for 32 unsigned bytes a and 32 signed bytes b, in int32. Three ways to the same
   integers, chosen when the kernel is compiled:
   - VNNI: one VPDPBUSD (AVX512_VNNI with AVX512VL, EVEX-encoded: the avx512vnni and amx kernels; AVX-VNNI,
     VEX-encoded: the avxvnni kernel). Exact for any bytes (no saturation).
   - SK_DOT_TWIN: a plain-integer stand-in for VPDPBUSD on AVX2 (the bytes widened to 16 bits, products summed
     in 32), exact for any bytes. Tests build the avx2 source with it ("vnni-twin"), so that the code the
     VNNI kernels run is checked, bit for bit, on a CPU without VNNI.
   - AVX2: VPMADDUBSW then VPMADDWD. VPMADDUBSW saturates each pair sum a_i b_i + a_{i+1} b_{i+1} to int16; the
     operands of quant.h's formats keep it within range (weights 0-31, or |w| <= 128 with Q8_0's sign moved to
     the activations; activations |x| <= 127: at most 2 * 128 * 127 = 32512), so it is exact here.
   SK_DOT_ANY_BYTES says whether q_dot4 is exact for any bytes (VNNI and the twin), which lets a tile take Q8_0's
   signed weights as w + 128 and subtract 128 times the activations' sum, instead of moving their signs. */
#ifndef SPECSERVE_KERNEL_DOT4_H
#define SPECSERVE_KERNEL_DOT4_H

#include <immintrin.h>

#if defined(SK_DOT_TWIN)
#define SK_DOT_KIND "twin"
#define SK_DOT_ANY_BYTES 1
static inline __attribute__((always_inline)) __m256i q_dot4(__m256i acc, __m256i a, __m256i b) {
    __m256i a0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(a)), a1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a, 1));
    __m256i b0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b)), b1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1));
    /* Pair sums of bytes 0-15 and 16-31 (each |a b| < 2^15, exact in int32), then adjacent pairs: hadd gives
       the quads in the order 0 1 4 5 | 2 3 6 7, which one permute of 64-bit halves puts back in order. */
    __m256i quads = _mm256_hadd_epi32(_mm256_madd_epi16(a0, b0), _mm256_madd_epi16(a1, b1));
    return _mm256_add_epi32(acc, _mm256_permute4x64_epi64(quads, 0xd8));
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SK_DOT_KIND "avx512vnni"
#define SK_DOT_ANY_BYTES 1
static inline __attribute__((always_inline)) __m256i q_dot4(__m256i acc, __m256i a, __m256i b) {
    return _mm256_dpbusd_epi32(acc, a, b);
}
#elif defined(__AVXVNNI__)
#define SK_DOT_KIND "avxvnni"
#define SK_DOT_ANY_BYTES 1
static inline __attribute__((always_inline)) __m256i q_dot4(__m256i acc, __m256i a, __m256i b) {
    return _mm256_dpbusd_avx_epi32(acc, a, b);
}
#else
#define SK_DOT_KIND "avx2"
#define SK_DOT_ANY_BYTES 0
static inline __attribute__((always_inline)) __m256i q_dot4(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
#endif

/* Which of the three this library was built with (tests read it to know what ran). */
const char *sk_dot_kind(void) { return SK_DOT_KIND; }

#endif
