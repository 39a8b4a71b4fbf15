/* Products on GGUF quantized weights 16 columns at a time (quant_tile.h at 16 lanes: two adjacent x8 groups in
   each __m512i), for the AVX-512 kernels built with VNNI and BW (avx512vnni, amxint8, amx); the same bits as the
   8-lane tiles; many rows on AMX-INT8 tiles where the build has them (quant_amx.h: amxint8, amx; the amx-twin
   stand-in). q_cols picks the widest driver the build has. */
#ifndef SPECSERVE_KERNEL_QUANT_AVX512_H
#define SPECSERVE_KERNEL_QUANT_AVX512_H

#include "quant_avx2.h"

/* 16 floats -> 16 bf16 as sk_f32_to_bf16 (nearest even, NaN kept NaN): every AVX-512 kernel's rounding. */
QINLINE __m256i q_bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), nan);
    return _mm512_cvtepi32_epi16(r);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Two adjacent x8 groups in one vector (the second group's bytes G further): 32 bytes of each, 8 float16 of
   each to float32, 8 bytes of each widened to a lane each (signed or not). */
QINLINE __m512i q16_load(const uint8_t *p, long G) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + G)), 1);
}

/* acc + the dot4 of W's bytes (unsigned) with the 4 signed bytes at p broadcast to every lane: the broadcast as
   the instruction's memory operand (gcc does not fold _mm512_set1_epi32 into vpdpbusd, and a tile's separate
   broadcasts were a quarter of its instructions). */
QINLINE __m512i q16_dot4_at(__m512i acc, __m512i W, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(W), "m"(*(const int32_t *)p));
    return acc;
}

/* a's lanes shifted left by the int32 at n, broadcast as the instruction's memory operand (as q16_dot4_at). */
QINLINE __m512i q16_sllv_at(__m512i a, const int32_t *n) {
    __asm__("vpsllvd %1%{1to16%}, %0, %0" : "+v"(a) : "m"(*n));
    return a;
}

/* acc + the sums of adjacent 16-bit products of a's lanes and the two int16 at p broadcast (VPDPWSSD). */
QINLINE __m512i q16_dot2_at(__m512i acc, __m512i a, const int32_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*p));
    return acc;
}

QINLINE __m512 q16_half(const uint8_t *p, long G) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                   _mm_loadu_si128((const __m128i *)(p + G)), 1));
}

QINLINE __m512i q16_bytes(const uint8_t *p, long G, int sign) {
    const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p), _mm_loadl_epi64((const __m128i *)(p + G)));
    return sign ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

/* sk_finish on 16 sums side by side (q_finish8's operations at 16 lanes). */
QINLINE void q_finish16(const float *sums, const float *bias, const uint16_t *residual, uint16_t *y) {
    __m512 f = _mm512_loadu_ps(sums);
    if (bias) f = _mm512_add_ps(f, _mm512_loadu_ps(bias));
    __m256i h = q_bf16x16(f);
    if (residual) {
        const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)residual)), 16));
        h = q_bf16x16(_mm512_add_ps(a, b));
    }
    _mm256_storeu_si256((__m256i *)y, h);
}

#define QW 16
#include "quant_tile.h"
#undef QW
#if defined(__AMX_INT8__) || defined(SK_AMX_TWIN)
#include "quant_amx.h"
#define q_cols q_cols_amx
#else
#define q_cols q_cols_16
#endif
#else
#define q_cols q_cols_8
#endif

#endif
