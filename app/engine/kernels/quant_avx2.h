/* Products on GGUF quantized weights with AVX2, FMA and F16C (quant.h's arithmetic: the generic kernel's bits).
   Included by the avx2 kernel and by the AVX-512 ones (avx512, amx), which run it as it is.

   A tile is R input rows x 8 weight rows (columns of the output), every input in order, each block's weights
   unpacked once for the R rows and meeting each row's quantized inputs in 4-byte integer dot products (dot4.h).
   Every format's tile (quant_tile.h: x8_tile; the K-quants' kx8_tile) takes 8 columns at a time in the lanes of
   one vector, from quant.h's x8 layout (16 in the AVX-512 VNNI kernels, quant_avx512.h). Unpacking once for
   the R rows is what several rows (a verification, a prefill) save. */
#ifndef SPECSERVE_KERNEL_QUANT_AVX2_H
#define SPECSERVE_KERNEL_QUANT_AVX2_H

#include <immintrin.h>
#include "dot4.h"
#include "quant.h"

#define QINLINE static inline __attribute__((always_inline))

/* The 4 bytes at p as one 32-bit value (a group of 4 quantized inputs, broadcast to every lane of a dot4). */
QINLINE int32_t q_load4(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return four;
}

/* 8 floats -> 8 bf16, rounded to nearest even (NaN kept NaN), as sk_f32_to_bf16. */
QINLINE __m128i q_bf16x8(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8));
}

/* Integer products (quant.h's sk_q_int formats; the generic kernel's bits). */

/* 32 bf16 at p widened to float32, and their largest magnitude. */
QINLINE float q_widen32(const uint16_t *p, __m256 *v) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8 * i))), 16));
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    return _mm_cvtss_f32(m4);
}

/* Chunk b of row r (its 32 inputs widened in v) at the step 1 / id: its xq and sk_qrows_chunk's fields. */
QINLINE void q8_chunk(const __m256 *v, float id, const sk_qrows *rows, int r, int b, float dx, int e) {
    const __m256 idv = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  /* nearest, ties even */
    /* 32 int32 -> 32 int8 in input order. */
    __m256i w16 = _mm256_packs_epi32(q[0], q[1]), x16 = _mm256_packs_epi32(q[2], q[3]);
    __m256i b8 = _mm256_packs_epi16(w16, x16);
    b8 = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)(rows->q + (size_t)r * rows->k + 32 * b), b8);
    __m256i x4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), b8), _mm256_set1_epi16(1));
    /* The 4-input sums of each half to both halves' sums (lanes 0 and 4). */
    x4 = _mm256_add_epi32(x4, _mm256_shuffle_epi32(x4, 0x4e));
    x4 = _mm256_add_epi32(x4, _mm256_shuffle_epi32(x4, 0xb1));
    sk_qrows_chunk(rows, r, b, dx, e, _mm256_cvtsi256_si32(x4), _mm_cvtsi128_si32(_mm256_extracti128_si256(x4, 1)));
}

/* Row r of x quantized (sk_quantize_row_ref's values): per block of rows->qa inputs its largest magnitude, then
   each 32 of them at their step (widened once, kept for both). */
static void q8_quantize_row(const uint16_t *x, const sk_qrows *rows, int r) {
    const int nb = rows->k / 32, per = rows->qa / 32;
    __m256 v[8][4];
    for (int a = 0; a < nb; a += per) {
        float amax = 0.0f, chunk[8];
        for (int b = 0; b < per; b++) amax = fmaxf(amax, chunk[b] = q_widen32(x + 32 * (a + b), v[b]));
        const float dx = amax / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
        for (int b = 0; b < per; b++) {
            const int e = per > 1 ? sk_q_step(chunk[b], amax) : 0;
            q8_chunk(v[b], id * (float)(1 << e), rows, r, a + b, dx, e);
        }
    }
}

#ifndef Q8_AHEAD
#define Q8_AHEAD 2
#endif

/* sk_finish on 8 sums side by side: the bias added, rounded to bf16, the residual added and rounded again. */
QINLINE void q_finish8(const float *sums, const float *bias, const uint16_t *residual, uint16_t *y) {
    __m256 f = _mm256_loadu_ps(sums);
    if (bias) f = _mm256_add_ps(f, _mm256_loadu_ps(bias));
    __m128i h = q_bf16x8(f);
    if (residual) {
        __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)residual)), 16));
        h = q_bf16x8(_mm256_add_ps(a, b));
    }
    _mm_storeu_si128((__m128i *)y, h);
}

typedef void (*q_tile_fn)(int R, const uint8_t *g, long rb, const sk_qrows *xq, int r0, float *s, int ahead);

/* The tiles and q_cols_8, 8 columns in the lanes of one __m256i. */
#define QW 8
#include "quant_tile.h"
#undef QW

#endif
