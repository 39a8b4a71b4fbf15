/* Products on GGUF quantized weights with AVX2, FMA and F16C (quant.h's arithmetic: the generic kernel's bits).
   Included by the avx2 kernel and by the AVX-512 ones (avx512, amx), which run it as it is.

   A tile is R input rows x C weight rows (columns of the output), every input in order, each block's weights
   unpacked once for the R rows and meeting each row's quantized inputs in 4-byte integer dot products (dot4.h).
   The 32-input formats (x8_tile) take 8 columns at a time in the lanes of one vector, from quant.h's x8 layout;
   the K-quants (qk_tile) one accumulator of 8 lanes per (row, column). Unpacking once for the R rows is what
   several rows (a verification, a prefill) save. */
#ifndef SPECSERVE_KERNEL_QUANT_AVX2_H
#define SPECSERVE_KERNEL_QUANT_AVX2_H

#include <immintrin.h>
#include "dot4.h"
#include "quant.h"

#define QINLINE static inline __attribute__((always_inline))

QINLINE float q_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
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

/* The two halves at p (a block's scale and offset) -> both broadcast, from one load and one conversion. */
QINLINE void q_halves(const uint8_t *p, __m256 *a, __m256 *b) {
    int32_t both;
    memcpy(&both, p, 4);
    __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
    *a = _mm256_broadcastss_ps(f);
    *b = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
}

/* A Q4_K or Q5_K block's chunk scales D = d * sc -> ds and offsets M = -(dmin * mn) -> dm, lane s for chunk s:
   the 8 sub-blocks' 6-bit scales and minimums (sk_k_scale_min) unpacked in 8 lanes at once: for j < 4 the low 6
   bits of bytes j and j + 4; for j >= 4 the nibbles of byte j + 4 under the top 2 bits of bytes j - 4 and j. The
   products are the scalar ones, lane by lane. */
QINLINE void q_k_scales(const uint8_t *b, __m256 *ds, __m256 *dm) {
    __m256 d, dmin;
    q_halves(b, &d, &dmin);
    __m128i v = _mm_loadu_si128((const __m128i *)(b + 4));                    /* the 12 packed bytes (and 4 more) */
    const __m128i low = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i high = _mm_setr_epi8(4, 5, 6, 7, 0, 1, 2, 3, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i mins = _mm_setr_epi8(4, 5, 6, 7, 8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i top = _mm_setr_epi8(0, 0, 0, 0, 4, 5, 6, 7, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i a = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(v, low));   /* j < 4: scale byte; else: its nibbles' byte */
    __m256i hs = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(v, high)); /* j >= 4: byte j - 4 (top bits of the scale) */
    __m256i c = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(v, mins));  /* the minimum's byte, or nibbles' byte */
    __m256i hm = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(v, top));  /* j >= 4: byte j (top bits of the minimum) */
    const __m256i upper = _mm256_setr_epi32(0, 0, 0, 0, -1, -1, -1, -1);
    const __m256i six = _mm256_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15);
    __m256i sc = _mm256_or_si256(_mm256_and_si256(a, six),
                                 _mm256_and_si256(_mm256_slli_epi32(_mm256_srli_epi32(hs, 6), 4), upper));
    __m256i mn = _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(c, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), six),
                                 _mm256_and_si256(_mm256_slli_epi32(_mm256_srli_epi32(hm, 6), 4), upper));
    *ds = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
    *dm = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)), _mm256_set1_ps(-0.0f));
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
        _mm256_storeu_si256((__m256i *)(rows->x4 + ((size_t)r * nb + b) * 8), x4);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(x4), _mm256_extracti128_si256(x4, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        rows->d[(size_t)r * nb + b] = dx;
        rows->s[(size_t)r * nb + b] = dx * (float)_mm_cvtsi128_si32(s4);
        rows->xs[(size_t)r * nb + b] = _mm_cvtsi128_si32(s4);
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

/* One format's x8 tiles, the format and the row count constants in each. */
#define X8_TILES(T)                                                                                             \
    static void x8_tile_##T(int R, const uint8_t *g, long rb, const sk_qrows *xq, int r0, float *s) {          \
        switch (R) {                                                                                            \
            case 4: x8_tile(T, 4, g, rb, xq, r0, s); break;                                                    \
            case 3: x8_tile(T, 3, g, rb, xq, r0, s); break;                                                    \
            case 2: x8_tile(T, 2, g, rb, xq, r0, s); break;                                                    \
            default: x8_tile(T, 1, g, rb, xq, r0, s); break;                                                   \
        }                                                                                                       \
    }
X8_TILES(SK_Q4_0)
X8_TILES(SK_Q4_1)
X8_TILES(SK_Q5_0)
X8_TILES(SK_Q5_1)
X8_TILES(SK_Q8_0)

/* A K-quant's chunk s of block p as 32 bytes in input order: Q4_K's nibbles (0-15), Q5_K's with their fifth
   bits (0-31), Q6_K's 6-bit quants (0-63; its zero point 32 is the tile's). */
QINLINE __m256i qk_weights(int type, const uint8_t *p, int s) {
    const __m256i nibble = _mm256_set1_epi8(15);
    if (type == SK_Q6_K) {
        int h = s / 4, i = s % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (i & 1)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
        __m256i lo = _mm256_and_si256(i >> 1 ? _mm256_srli_epi16(ql, 4) : ql, nibble);
        /* Bits 2i, 2i + 1 of each byte to bits 4, 5 (16-bit shifts: the mask drops what crosses a byte). */
        __m256i hi = i < 2 ? _mm256_slli_epi16(qh, 4 - 2 * i) : i > 2 ? _mm256_srli_epi16(qh, 2 * i - 4) : qh;
        return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
    }
    __m256i qs = _mm256_loadu_si256((const __m256i *)(p + (type == SK_Q4_K ? 16 : 48) + 32 * (s / 2)));
    __m256i q = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(qs, 4) : qs, nibble);
    if (type == SK_Q5_K) {
        __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));  /* bit s of byte j: input j's fifth bit */
        __m256i bit = s < 4 ? _mm256_slli_epi16(qh, 4 - s) : s > 4 ? _mm256_srli_epi16(qh, s - 4) : qh;
        q = _mm256_or_si256(q, _mm256_and_si256(bit, _mm256_set1_epi8(16)));
    }
    return q;
}

#ifndef QK_AHEAD
#define QK_AHEAD 2
#endif

/* q8_tile for the K-quants (Q4_K, Q5_K, Q6_K), R * C <= 8, slot i = c * R + r.

   Per 256-input block: each column's 8 chunk scales (Q6_K: 16 half-chunk scales) times each row's 8 chunk dx,
   as vectors, stored to be broadcast by loads; then chunk by chunk, a column's 32 weights unpacked once for
   its rows, each (row, column) one q_dot4, one conversion and one fused multiply-add; Q6_K's zero point starts
   the integer sum at -32 times the lane's activation sum. Q4_K and Q5_K's offsets: after the block, each lane
   j takes chunk j's, one fused multiply-add of 8 lanes per (row, column). */
QINLINE void qk_tile(int type, int R, int C, const uint8_t *w, long row_bytes, const sk_qrows *xq, int r0, float *sums) {
    const int k = xq->k, nb = k / 32, bytes = sk_q_bytes(type), six = type == SK_Q6_K;
    const int8_t *xrows = xq->q + (size_t)r0 * k;     /* row r, chunk b: xrows + r * k + 32 b */
    const float *dx = xq->d + (size_t)r0 * nb, *sx = xq->s + (size_t)r0 * nb;
    const int32_t *x4 = xq->x4 + (size_t)r0 * nb * 8;  /* row r, chunk b: x4 + (r * nb + b) * 8 */
    const __m256 z = _mm256_setzero_ps();
    __m256 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z;
    /* Slot i's D * dx, lane s for chunk s (Q6_K: lanes 2s, 2s + 1 for its halves, 16 lanes). */
    float dd[8][16] __attribute__((aligned(32)));
    const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (int blk = 0; blk < k / 256; blk++) {
        const int b8 = 8 * blk;
        __m256 xd[4][2], dm[8];
        for (int r = 0; r < R; r++) {
            xd[r][0] = _mm256_loadu_ps(dx + (size_t)r * nb + b8);
            if (six) {
                /* Q6_K's scales run in pairs per chunk: dx of chunks 0-3, then 4-7, each twice. */
                xd[r][1] = _mm256_permutevar8x32_ps(xd[r][0], _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
                xd[r][0] = _mm256_permutevar8x32_ps(xd[r][0], _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
            }
        }
        for (int c = 0; c < C; c++) {
            const uint8_t *p = w + c * row_bytes + (size_t)blk * bytes;
            __m256 ds[2];
            if (six) {
                __m256 d = _mm256_set1_ps(q_half(p + 208));
                ds[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 192)))));
                ds[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 200)))));
            } else {
                q_k_scales(p, &ds[0], &dm[c]);
            }
            for (int r = 0; r < R; r++) {
                _mm256_store_ps(dd[c * R + r], _mm256_mul_ps(ds[0], xd[r][0]));
                if (six) _mm256_store_ps(dd[c * R + r] + 8, _mm256_mul_ps(ds[1], xd[r][1]));
            }
        }
        /* Read back by broadcast loads (see q8_tile). */
        __asm__ volatile("" ::: "memory");
        for (int s = 0; s < 8; s++) {
            const int b = b8 + s;
            __m256i init[4], wq = _mm256_setzero_si256();
            for (int r = 0; r < R; r++)
                init[r] = six ? _mm256_sub_epi32(_mm256_setzero_si256(),
                                                 _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(x4 + ((size_t)r * nb + b) * 8)), 5))
                              : _mm256_setzero_si256();
#define QK_SLOT(i)                                                                                                 \
            if (i < R * C) {                                                                                       \
                const int c = i / R, r = i % R;                                                                    \
                const uint8_t *p = w + c * row_bytes + (size_t)blk * bytes;                                        \
                if (r == 0) {                                                                                      \
                    /* A column's block is a few cache lines: ask for the columns two tiles ahead. */             \
                    if (64 * s < bytes) _mm_prefetch((const char *)(p + QK_AHEAD * C * row_bytes + 64 * s), _MM_HINT_T0); \
                    wq = qk_weights(type, p, s);                                                                   \
                }                                                                                                  \
                __m256i x = _mm256_loadu_si256((const __m256i *)(xrows + (size_t)r * k + 32 * b));                 \
                __m256 scale = six ? _mm256_permutevar_ps(_mm256_castpd_ps(_mm256_broadcast_sd((const double *)&dd[i][2 * s])), halves) \
                                   : _mm256_broadcast_ss(&dd[i][s]);                                              \
                a##i = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(q_dot4(init[r], wq, x)), a##i);                   \
            }
            QK_SLOT(0) QK_SLOT(1) QK_SLOT(2) QK_SLOT(3) QK_SLOT(4) QK_SLOT(5) QK_SLOT(6) QK_SLOT(7)
#undef QK_SLOT
        }
        if (!six) {
#define QK_OFFSET(i)                                                                                               \
            if (i < R * C) a##i = _mm256_fmadd_ps(dm[i / R], _mm256_loadu_ps(sx + (size_t)(i % R) * nb + b8), a##i);
            QK_OFFSET(0) QK_OFFSET(1) QK_OFFSET(2) QK_OFFSET(3) QK_OFFSET(4) QK_OFFSET(5) QK_OFFSET(6) QK_OFFSET(7)
#undef QK_OFFSET
        }
    }
    __m256 all[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int i = 0; i < R * C; i++) {
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(all[i]), _mm256_extractf128_ps(all[i], 1));
        __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        sums[(i % R) * C + i / R] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    }
}

/* One K-quant's tiles, the format and the tile shape constants in each. */
#define Q8_TILES(T, TILE)                                                                                     \
    static void q8_tile_##T(int R, int C, const uint8_t *w, long rb, const sk_qrows *xq, int r0, float *s) { \
        switch (R * 8 + C) {                                                                                  \
            case 1 * 8 + 8: TILE(T, 1, 8, w, rb, xq, r0, s); break;                                           \
            case 1 * 8 + 4: TILE(T, 1, 4, w, rb, xq, r0, s); break;                                           \
            case 4 * 8 + 2: TILE(T, 4, 2, w, rb, xq, r0, s); break;                                           \
            case 3 * 8 + 2: TILE(T, 3, 2, w, rb, xq, r0, s); break;                                           \
            case 2 * 8 + 2: TILE(T, 2, 2, w, rb, xq, r0, s); break;                                           \
            case 1 * 8 + 2: TILE(T, 1, 2, w, rb, xq, r0, s); break;                                           \
            case 4 * 8 + 1: TILE(T, 4, 1, w, rb, xq, r0, s); break;                                           \
            case 3 * 8 + 1: TILE(T, 3, 1, w, rb, xq, r0, s); break;                                           \
            case 2 * 8 + 1: TILE(T, 2, 1, w, rb, xq, r0, s); break;                                           \
            default: TILE(T, 1, 1, w, rb, xq, r0, s); break;                                                  \
        }                                                                                                     \
    }
Q8_TILES(SK_Q4_K, qk_tile)
Q8_TILES(SK_Q5_K, qk_tile)
Q8_TILES(SK_Q6_K, qk_tile)

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

typedef void (*q8_tile_fn)(int R, int C, const uint8_t *w, long rb, const sk_qrows *xq, int r0, float *s);
typedef void (*x8_tile_fn)(int R, const uint8_t *g, long rb, const sk_qrows *xq, int r0, float *s);

/* Columns c0..c1-1 (c0 a multiple of 8) for every row. The 32-input formats: 8 columns (an x8 group) at a time
   over rows 4 at a time, the group's weights read again from the cache for each 4 rows. The K-quants: columns 8
   at a time for a lone row, else 2 at a time over rows 4 at a time; the last columns one at a time. */
static void q8_cols(int type, const uint8_t *w, long row_bytes, const sk_qrows *xq, uint16_t *y, int ldy,
                    const float *bias, int m, int k, int c0, int c1, const uint16_t *residual) {
    (void)k;
    float sums[32];
    if (sk_x8(type)) {
        x8_tile_fn tile = type == SK_Q4_0 ? x8_tile_SK_Q4_0 : type == SK_Q4_1 ? x8_tile_SK_Q4_1
                        : type == SK_Q5_0 ? x8_tile_SK_Q5_0 : type == SK_Q5_1 ? x8_tile_SK_Q5_1 : x8_tile_SK_Q8_0;
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
        return;
    }
    q8_tile_fn tile = type == SK_Q4_K ? q8_tile_SK_Q4_K : type == SK_Q5_K ? q8_tile_SK_Q5_K : q8_tile_SK_Q6_K;
    int C = m == 1 ? 8 : 2;
    for (int col = c0; col < c1;) {
        int cc = col + C <= c1 ? C : C > 4 && col + 4 <= c1 ? 4 : 1;
        for (int r = 0; r < m; r += 4) {
            int R = r + 4 <= m ? 4 : m - r;
            tile(R, cc, w + (size_t)col * row_bytes, row_bytes, xq, r, sums);
            for (int i = 0; i < R; i++)
                for (int j = 0; j < cc; j++) {
                    size_t at = (size_t)(r + i) * ldy + col + j;
                    y[at] = sk_finish(sums[i * cc + j], bias, col + j, residual ? residual + at : NULL);
                }
        }
        col += cc;
    }
}

#endif
