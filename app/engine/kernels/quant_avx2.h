/* Products on GGUF quantized weights with AVX2, FMA and F16C (quant.h's arithmetic: the generic kernel's bits).
   Included by the avx2 kernel and by the AVX-512 ones (avx512, amx), which run it as it is.

   A tile is R input rows x 8 weight rows (columns of the output), every input in order, each block's weights
   unpacked once for the R rows and meeting each row's quantized inputs in 4-byte integer dot products (dot4.h).
   Every format's tile (x8_tile; the K-quants' kx8_tile) takes 8 columns at a time in the lanes of one vector,
   from quant.h's x8 layout. Unpacking once for the R rows is what several rows (a verification, a prefill)
   save. */
#ifndef SPECSERVE_KERNEL_QUANT_AVX2_H
#define SPECSERVE_KERNEL_QUANT_AVX2_H

#include <immintrin.h>
#include "dot4.h"
#include "quant.h"

#define QINLINE static inline __attribute__((always_inline))

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

/* Row r of x quantized (sk_quantize_row_ref's values). */
static void q8_quantize_row(const uint16_t *x, const sk_qrows *rows, int r) {
    int k = rows->k, nb = k / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < nb; b++) {
        const uint16_t *xb = x + 32 * b;
        __m256 v[4];
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xb + 8 * i))), 16));
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        float amax = _mm_cvtss_f32(m4);
        float dx = amax / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
        __m256 idv = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  /* nearest, ties even */
        /* 32 int32 -> 32 int8 in input order. */
        __m256i w16 = _mm256_packs_epi32(q[0], q[1]), x16 = _mm256_packs_epi32(q[2], q[3]);
        __m256i b8 = _mm256_packs_epi16(w16, x16);
        b8 = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(rows->q + (size_t)r * k + 32 * b), b8);
        __m256i x4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), b8), _mm256_set1_epi16(1));
        /* The 4-input sums of each half to both halves' sums (lanes 0 and 4), then the block's. */
        x4 = _mm256_add_epi32(x4, _mm256_shuffle_epi32(x4, 0x4e));
        x4 = _mm256_add_epi32(x4, _mm256_shuffle_epi32(x4, 0xb1));
        int32_t *xh = rows->xh + ((size_t)r * nb + b) * 2;
        xh[0] = _mm256_cvtsi256_si32(x4);
        xh[1] = _mm_cvtsi128_si32(_mm256_extracti128_si256(x4, 1));
        const int32_t sum = xh[0] + xh[1];
        rows->d[(size_t)r * nb + b] = dx;
        rows->s[(size_t)r * nb + b] = dx * (float)sum;
        rows->xs[(size_t)r * nb + b] = sum;
    }
}

#ifndef Q8_AHEAD
#define Q8_AHEAD 2
#endif

/* Column c's 4-byte group i of an x8 block in lane c: W_i (inputs 4i..4i+3), from the 4-bit formats' P_(i % 4)
   (low nibbles for i < 4, high for the rest) and, for Q5_*, H's bit i of each byte as the fifth bit (quant.h). */
QINLINE __m256i x8_nibbles(__m256i P, int i, int five, __m256i H) {
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256i q = _mm256_and_si256(i < 4 ? P : _mm256_srli_epi16(P, 4), nibble);
    if (five) {
        /* Bit 8t + i of each 32-bit lane to bit 8t + 4 (32-bit shifts: the mask drops what crosses a byte). */
        __m256i bit = i < 4 ? _mm256_slli_epi32(H, 4 - i) : i > 4 ? _mm256_srli_epi32(H, i - 4) : H;
        q = _mm256_or_si256(q, _mm256_and_si256(bit, _mm256_set1_epi8(16)));
    }
    return q;
}

/* R rows (from r0, R <= 4) x the 8 columns of the x8 group g (quant.h) -> sums [R][8].

   Per block: each 4-byte group of the 8 columns' weights, one vector (lane c: column c), is unpacked once for
   the R rows and meets each row's 4 activations of that group broadcast, so that a row's integer sums of 8
   columns take 8 dot4 steps and its scaling one conversion, one multiply and one fused multiply-add, for 8
   columns. The zero points (Q4_0's 8, Q5_0's 16; Q8_0's weights taken as w + 128 where q_dot4 takes any bytes)
   start each sum at minus that many times the row's block sum xs; without VNNI Q8_0's signs move to the
   activations. The loops run unrolled (gcc keeps the accumulators in registers only then). */
QINLINE void x8_tile(int type, int R, const uint8_t *g, long row_bytes, const sk_qrows *xq, int r0, float *sums) {
    const int k = xq->k, nb = k / 32, bytes = sk_q_bytes(type);
    const int offset = type == SK_Q4_1 || type == SK_Q5_1, five = type == SK_Q5_0 || type == SK_Q5_1;
    const int at_h = 16 * (1 + offset), at_q = at_h + 32 * five, q8 = type == SK_Q8_0;
    const int zero = type == SK_Q4_0 ? 8 : type == SK_Q5_0 ? 16 : q8 && SK_DOT_ANY_BYTES ? 128 : 0;
    const int8_t *xr = xq->q + (size_t)r0 * k;
    const float *dx = xq->d + (size_t)r0 * nb, *sx = xq->s + (size_t)r0 * nb;
    const int32_t *xs = xq->xs + (size_t)r0 * nb;
    __m256 acc[4], ov[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) acc[r] = ov[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = g + (size_t)b * 8 * bytes;
        /* Two groups ahead: the rest of this thread's share streams after this group. */
#pragma GCC unroll 5
        for (int line = 0; line < 8 * bytes; line += 64)
            _mm_prefetch((const char *)(p + Q8_AHEAD * 8 * row_bytes + line), _MM_HINT_T0);
        /* One integer sum per row; two for a lone row, to halve the chain of dependent dot4 steps. */
        __m256i ia[4], ib = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            ia[r] = zero ? _mm256_set1_epi32(-zero * xs[(size_t)r * nb + b]) : _mm256_setzero_si256();
        __m256i H = five ? _mm256_loadu_si256((const __m256i *)(p + at_h)) : _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            __m256i W;
            if (q8) {
                W = _mm256_loadu_si256((const __m256i *)(p + at_q + 32 * i));
            } else {
                W = x8_nibbles(_mm256_loadu_si256((const __m256i *)(p + at_q + 32 * (i % 4))), i, five, H);
            }
            __m256i Wa = q8 ? (SK_DOT_ANY_BYTES ? _mm256_xor_si256(W, _mm256_set1_epi8(-128)) : _mm256_abs_epi8(W)) : W;
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xr + (size_t)r * k + 32 * b + 4 * i, 4);
                __m256i x = _mm256_set1_epi32(four);
                if (q8 && !SK_DOT_ANY_BYTES) x = _mm256_sign_epi8(x, W);
                if (R == 1 && i % 2)
                    ib = q_dot4(ib, Wa, x);
                else
                    ia[r] = q_dot4(ia[r], Wa, x);
            }
        }
        if (R == 1) ia[0] = _mm256_add_epi32(ia[0], ib);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        __m256 m = offset ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))) : _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(dx[(size_t)r * nb + b]));
            acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(ia[r]), acc[r]);
            if (offset) ov[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[(size_t)r * nb + b]), ov[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm256_storeu_ps(sums + 8 * r, offset ? _mm256_add_ps(acc[r], ov[r]) : acc[r]);
}


/* Column c's 4-byte group i of a Q6_K chunk in lane c (inputs 4i..4i+3; 0-63, its zero point 32 the tile's):
   P_(i % 4)'s low or high nibbles under T_(i / 4)'s bits 2u, 2u + 1 (u = i % 4) as bits 4, 5 (quant.h). */
QINLINE __m256i x8_six(__m256i P, int i, __m256i T) {
    const int u = i % 4;
    __m256i q = _mm256_and_si256(i < 4 ? P : _mm256_srli_epi16(P, 4), _mm256_set1_epi8(15));
    /* 16-bit shifts: the mask drops what crosses a byte. */
    __m256i hi = u < 2 ? _mm256_slli_epi16(T, 4 - 2 * u) : u > 2 ? _mm256_srli_epi16(T, 2 * u - 4) : T;
    return _mm256_or_si256(q, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

/* x8_tile for the K-quants (Q4_K, Q5_K, Q6_K): R rows (R <= 4) x the 8 columns of an x8 group -> sums [R][8].

   Per 256-input block: d (and dmin, negated) of the 8 columns converted once; per chunk, the 8 columns' scales
   (and minimums) unpacked from S and U (Q6_K: its two halves' int8 scales), then as x8_tile: 8 dot4 steps of
   each 4-byte group unpacked once for the R rows, one conversion, one multiply and one fused multiply-add per
   row for 8 columns (Q6_K: two, one per half, each half's integer sum started at -32 times the row's sum of
   that half); the minimums' chain one fused multiply-add more. */
QINLINE void kx8_tile(int type, int R, const uint8_t *g, long row_bytes, const sk_qrows *xq, int r0, float *sums) {
    const int k = xq->k, nb = k / 32, bytes = sk_q_bytes(type);
    const int six = type == SK_Q6_K, five = type == SK_Q5_K, at_q = six ? 656 : 128 + 256 * five;
    const int8_t *xr = xq->q + (size_t)r0 * k;
    const float *dx = xq->d + (size_t)r0 * nb, *sx = xq->s + (size_t)r0 * nb;
    const int32_t *xh = xq->xh + (size_t)r0 * nb * 2;
    const __m256i low4 = _mm256_set1_epi32(15), top2 = _mm256_set1_epi32(0x30);
    __m256 acc[4], ov[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) acc[r] = ov[r] = _mm256_setzero_ps();
    for (int blk = 0; blk < k / 256; blk++) {
        const uint8_t *p = g + (size_t)blk * 8 * bytes;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 ndmin = six ? d : _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))),
                                                     _mm256_set1_ps(-0.0f));
        __m256i U = six ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(p + 96));
#pragma GCC unroll 1
        for (int s = 0; s < 8; s++) {
            const int b = 8 * blk + s;
            const uint8_t *P = p + at_q + 128 * s;
            /* Two groups ahead, a quarter of a group block per chunk: the rest of the share streams behind. */
            for (int line = 256 * s; line < 256 * (s + 1) && line < 8 * bytes; line += 64)
                _mm_prefetch((const char *)(p + Q8_AHEAD * 8 * row_bytes + line), _MM_HINT_T0);
            __m256 D[2], M = _mm256_setzero_ps();
            if (six) {
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++)
                    D[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 + 16 * s + 8 * h)))));
            } else {
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 32 + 8 * s)));
                __m256i sc = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_slli_epi32(U, 4), top2));
                __m256i mn = _mm256_or_si256(_mm256_srli_epi32(v, 4), _mm256_and_si256(_mm256_slli_epi32(U, 2), top2));
                U = _mm256_srli_epi32(U, 4);
                D[0] = D[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                M = _mm256_mul_ps(ndmin, _mm256_cvtepi32_ps(mn));
            }
            /* Q6_K: one integer sum per half; the others: one, two for a lone row (to halve the chain of
               dependent dot4 steps), added before the conversion. */
            __m256i ia[4], ib[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int32_t *h = xh + ((size_t)r * nb + b) * 2;
                ia[r] = six ? _mm256_set1_epi32(-32 * h[0]) : _mm256_setzero_si256();
                ib[r] = six ? _mm256_set1_epi32(-32 * h[1]) : _mm256_setzero_si256();
            }
            const __m256i H = five ? _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * s)) : _mm256_setzero_si256();
            const __m256i T0 = six ? _mm256_loadu_si256((const __m256i *)(p + 144 + 64 * s)) : _mm256_setzero_si256();
            const __m256i T1 = six ? _mm256_loadu_si256((const __m256i *)(p + 176 + 64 * s)) : _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                __m256i Pq = _mm256_loadu_si256((const __m256i *)(P + 32 * (i % 4)));
                __m256i W = six ? x8_six(Pq, i, i < 4 ? T0 : T1) : x8_nibbles(Pq, i, five, H);
                const int second = six ? i >= 4 : R == 1 && i % 2;
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    int32_t four;
                    memcpy(&four, xr + (size_t)r * k + 32 * b + 4 * i, 4);
                    if (second)
                        ib[r] = q_dot4(ib[r], W, _mm256_set1_epi32(four));
                    else
                        ia[r] = q_dot4(ia[r], W, _mm256_set1_epi32(four));
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256 x = _mm256_set1_ps(dx[(size_t)r * nb + b]);
                if (six) {
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(D[0], x), _mm256_cvtepi32_ps(ia[r]), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(D[1], x), _mm256_cvtepi32_ps(ib[r]), acc[r]);
                } else {
                    __m256i i32 = R == 1 ? _mm256_add_epi32(ia[r], ib[r]) : ia[r];
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(D[0], x), _mm256_cvtepi32_ps(i32), acc[r]);
                    ov[r] = _mm256_fmadd_ps(M, _mm256_set1_ps(sx[(size_t)r * nb + b]), ov[r]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm256_storeu_ps(sums + 8 * r, six ? acc[r] : _mm256_add_ps(acc[r], ov[r]));
}

/* One format's x8 tiles, the format and the row count constants in each. */
#define X8_TILES(T, TILE)                                                                                       \
    static void x8_tile_##T(int R, const uint8_t *g, long rb, const sk_qrows *xq, int r0, float *s) {          \
        switch (R) {                                                                                            \
            case 4: TILE(T, 4, g, rb, xq, r0, s); break;                                                       \
            case 3: TILE(T, 3, g, rb, xq, r0, s); break;                                                       \
            case 2: TILE(T, 2, g, rb, xq, r0, s); break;                                                       \
            default: TILE(T, 1, g, rb, xq, r0, s); break;                                                      \
        }                                                                                                       \
    }
X8_TILES(SK_Q4_0, x8_tile)
X8_TILES(SK_Q4_1, x8_tile)
X8_TILES(SK_Q5_0, x8_tile)
X8_TILES(SK_Q5_1, x8_tile)
X8_TILES(SK_Q8_0, x8_tile)
X8_TILES(SK_Q4_K, kx8_tile)
X8_TILES(SK_Q5_K, kx8_tile)
X8_TILES(SK_Q6_K, kx8_tile)

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

typedef void (*x8_tile_fn)(int R, const uint8_t *g, long rb, const sk_qrows *xq, int r0, float *s);

/* Columns c0..c1-1 (c0 a multiple of 8) for every row: 8 columns (an x8 group) at a time over rows 4 at a time,
   the group's weights read again from the cache for each 4 rows. */
static void q8_cols(int type, const uint8_t *w, long row_bytes, const sk_qrows *xq, uint16_t *y, int ldy,
                    const float *bias, int m, int k, int c0, int c1, const uint16_t *residual) {
    (void)k;
    float sums[32];
    x8_tile_fn tile = type == SK_Q4_0 ? x8_tile_SK_Q4_0 : type == SK_Q4_1 ? x8_tile_SK_Q4_1
                    : type == SK_Q5_0 ? x8_tile_SK_Q5_0 : type == SK_Q5_1 ? x8_tile_SK_Q5_1
                    : type == SK_Q8_0 ? x8_tile_SK_Q8_0 : type == SK_Q4_K ? x8_tile_SK_Q4_K
                    : type == SK_Q5_K ? x8_tile_SK_Q5_K : x8_tile_SK_Q6_K;
    for (int col = c0; col < c1; col += 8) {
        int cc = c1 - col < 8 ? c1 - col : 8;
        for (int r = 0; r < m; r += 4) {
            int R = r + 4 <= m ? 4 : m - r;
            tile(R, w + (size_t)(col / 8) * 8 * row_bytes, row_bytes, xq, r, sums);
            for (int i = 0; i < R; i++) {
                size_t at = (size_t)(r + i) * ldy + col;
                if (cc == 8) {
                    q_finish8(sums + 8 * i, bias ? bias + col : NULL, residual ? residual + at : NULL, y + at);
                    continue;
                }
                for (int j = 0; j < cc; j++)
                    y[at + j] = sk_finish(sums[8 * i + j], bias, col + j, residual ? residual + at + j : NULL);
            }
        }
    }
}

#endif
