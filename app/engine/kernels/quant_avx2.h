/* Products on GGUF quantized weights with AVX2, FMA and F16C (quant.h's arithmetic: the generic kernel's bits).
   Included by the avx2 kernel and by the AVX-512 ones (avx512, amx), which run it as it is.

   A tile is R input rows x C weight rows (columns of the output), every input in order: for each 32-input
   chunk, each column's weights are dequantized into four 8-lane registers (inputs 0-7, 8-15, 16-23, 24-31
   of the chunk), then multiplied with each row's inputs into two accumulators per (row, column), lanes 0-7
   and 8-15 of quant.h's 16 (inputs 16c + i: the chunk's first half, then its second). Dequantizing once for
   the R rows is what several rows (a verification, a prefill) save. */
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

/* The two halves at p (a block's scale and offset) -> both broadcast, from one load and one conversion. */
QINLINE void q_halves(const uint8_t *p, __m256 *a, __m256 *b) {
    int32_t both;
    memcpy(&both, p, 4);
    __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
    *a = _mm256_broadcastss_ps(f);
    *b = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
}

/* 8 bytes at p -> 8 int32 lanes (one load-and-widen each: no shuffles of loaded registers). */
QINLINE __m256i q_u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
QINLINE __m256i q_i8x8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
QINLINE __m256i q_bits(__m256i v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(mask));
}
QINLINE __m256 q_float(__m256i v) { return _mm256_cvtepi32_ps(v); }

/* Q4_0/Q4_1's 16 bytes of nibbles at p -> the 32 quants as int32: inputs 0-7, 8-15 (low nibbles), 16-23,
   24-31 (high nibbles). */
QINLINE void q_nibbles(const uint8_t *p, __m256i *q) {
    __m256i a = q_u8x8(p), b = q_u8x8(p + 8), mask = _mm256_set1_epi32(15);
    q[0] = _mm256_and_si256(a, mask), q[1] = _mm256_and_si256(b, mask);
    q[2] = _mm256_srli_epi32(a, 4), q[3] = _mm256_srli_epi32(b, 4);
}

/* Q5_0/Q5_1's fifth bits (32 bits at p, bit j for input j) -> or'ed into q as 16. */
QINLINE void q_fifth(const uint8_t *p, __m256i *q) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    __m256i all = _mm256_set1_epi32((int)qh), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < 4; i++) {
        __m256i bit = _mm256_srlv_epi32(all, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * i)));
        q[i] = _mm256_or_si256(q[i], _mm256_slli_epi32(_mm256_and_si256(bit, _mm256_set1_epi32(1)), 4));
    }
}

/* Chunk s of block b, dequantized -> w[4] (the scalar definition: sk_q_chunk_ref). For the K-quants the
   chunk's scale and offset come from ks (see q_k_scales). */
typedef struct { float ds[8], dm[8]; } q_kscales;

/* The 8 sub-blocks' 6-bit scales and minimums (sk_k_scale_min) unpacked in 8 lanes at once: for j < 4 the low 6
   bits of bytes j and j + 4; for j >= 4 the nibbles of byte j + 4 under the top 2 bits of bytes j - 4 and j. The
   products d * sc and -(dmin * mn) are the scalar ones, lane by lane. */
QINLINE void q_k_scales(int type, const uint8_t *b, q_kscales *ks) {
    if (type == SK_Q6_K) return;
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
    _mm256_storeu_ps(ks->ds, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
    _mm256_storeu_ps(ks->dm, _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)), _mm256_set1_ps(-0.0f)));
}

QINLINE void q_chunk(int type, const uint8_t *b, int s, const q_kscales *ks, __m256 *w) {
    __m256i q[4];
    switch (type) {
        case SK_Q4_0: case SK_Q5_0: {
            __m256 d = _mm256_set1_ps(q_half(b));
            int five = type == SK_Q5_0;
            q_nibbles(b + (five ? 6 : 2), q);
            if (five) q_fifth(b + 2, q);
            __m256i zero = _mm256_set1_epi32(five ? 16 : 8);
            for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, q_float(_mm256_sub_epi32(q[i], zero)));
            break;
        }
        case SK_Q4_1: case SK_Q5_1: {
            __m256 d, m;
            q_halves(b, &d, &m);
            int five = type == SK_Q5_1;
            q_nibbles(b + (five ? 8 : 4), q);
            if (five) q_fifth(b + 4, q);
            for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(d, q_float(q[i]), m);
            break;
        }
        case SK_Q8_0: {
            __m256 d = _mm256_set1_ps(q_half(b));
            for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, q_float(q_i8x8(b + 2 + 8 * i)));
            break;
        }
        case SK_Q4_K: case SK_Q5_K: {
            const uint8_t *qs = b + (type == SK_Q4_K ? 16 : 48) + 32 * (s / 2);
            __m256 ds = _mm256_set1_ps(ks->ds[s]), dm = _mm256_set1_ps(ks->dm[s]);
            for (int i = 0; i < 4; i++) {
                __m256i v = q_bits(q_u8x8(qs + 8 * i), 4 * (s & 1), 15);
                if (type == SK_Q5_K) v = _mm256_or_si256(v, _mm256_slli_epi32(q_bits(q_u8x8(b + 16 + 8 * i), s, 1), 4));
                w[i] = _mm256_fmadd_ps(ds, q_float(v), dm);
            }
            break;
        }
        case SK_Q6_K: {
            int h = s / 4, i4 = s % 4;
            const uint8_t *ql = b + 64 * h + 32 * (i4 & 1), *qh = b + 128 + 32 * h;
            const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * i4;
            float d = q_half(b + 208);
            __m256 dd[2] = {_mm256_set1_ps(d * (float)sc[0]), _mm256_set1_ps(d * (float)sc[1])};
            for (int i = 0; i < 4; i++) {
                __m256i lo = q_bits(q_u8x8(ql + 8 * i), 4 * (i4 >> 1), 15), hi = q_bits(q_u8x8(qh + 8 * i), 2 * i4, 3);
                __m256i v = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
                w[i] = _mm256_mul_ps(dd[i / 2], q_float(v));
            }
            break;
        }
    }
}

/* The lane tree of two 8-lane halves (lanes 0-7, 8-15): sk_tree16. */
QINLINE float q_tree(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#ifndef Q_AHEAD
#define Q_AHEAD 2
#endif

/* R rows (x: k floats apart) x C columns (w: row_bytes apart) -> sums [R][C]. */
QINLINE void q_tile(int type, int R, int C, const uint8_t *w, long row_bytes, const float *x, int k, float *sums) {
    __m256 acc[4][4][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    int qk = sk_q_block(type), bytes = sk_q_bytes(type);
    for (int blk = 0; blk < k / qk; blk++) {
        q_kscales ks[4];
        /* The same block of the columns two tiles ahead, line by line (see q8_tile). */
        for (int c = 0; c < C; c++)
            for (int off = 0; off < bytes; off += 64)
                _mm_prefetch((const char *)(w + (Q_AHEAD * C + c) * row_bytes + (size_t)blk * bytes + off), _MM_HINT_T0);
        if (qk == 256)
            for (int c = 0; c < C; c++) q_k_scales(type, w + c * row_bytes + (size_t)blk * bytes, &ks[c]);
        for (int s = 0; s < qk / 32; s++) {
            int e = blk * qk + 32 * s;
            for (int c = 0; c < C; c++) {
                __m256 wv[4];
                q_chunk(type, w + c * row_bytes + (size_t)blk * bytes, s, &ks[c], wv);
                for (int r = 0; r < R; r++) {
                    const float *xr = x + (size_t)r * k + e;
                    acc[r][c][0] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xr), acc[r][c][0]);
                    acc[r][c][1] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xr + 8), acc[r][c][1]);
                    acc[r][c][0] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xr + 16), acc[r][c][0]);
                    acc[r][c][1] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xr + 24), acc[r][c][1]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r * C + c] = q_tree(acc[r][c][0], acc[r][c][1]);
}

/* One format's tiles, the format a constant in each (the K-quants: the 32-input formats take integer
   products, below). */
#define Q_TILES(T)                                                                                            \
    static void q_tile_##T(int R, int C, const uint8_t *w, long rb, const float *x, int k, float *sums) {     \
        switch (R * 8 + C) {                                                                                  \
            case 1 * 8 + 4: q_tile(T, 1, 4, w, rb, x, k, sums); break;                                        \
            case 2 * 8 + 2: q_tile(T, 2, 2, w, rb, x, k, sums); break;                                        \
            case 4 * 8 + 1: q_tile(T, 4, 1, w, rb, x, k, sums); break;                                        \
            case 3 * 8 + 1: q_tile(T, 3, 1, w, rb, x, k, sums); break;                                        \
            case 2 * 8 + 1: q_tile(T, 2, 1, w, rb, x, k, sums); break;                                        \
            default: q_tile(T, 1, 1, w, rb, x, k, sums); break;                                               \
        }                                                                                                     \
    }
Q_TILES(SK_Q4_K)
Q_TILES(SK_Q5_K)
Q_TILES(SK_Q6_K)

typedef void (*q_tile_fn)(int R, int C, const uint8_t *w, long rb, const float *x, int k, float *sums);

static q_tile_fn q_tiles_for(int type) {
    switch (type) {
        case SK_Q4_K: return q_tile_SK_Q4_K;
        case SK_Q5_K: return q_tile_SK_Q5_K;
        default: return q_tile_SK_Q6_K;
    }
}

/* A weight row (k inputs) dequantized -> out [k] float32: the values q_chunk gives, stored. */
QINLINE void q_row_t(int type, const uint8_t *row, int k, float *out) {
    int qk = sk_q_block(type), bytes = sk_q_bytes(type);
    for (int blk = 0; blk < k / qk; blk++) {
        const uint8_t *b = row + (size_t)blk * bytes;
        q_kscales ks;
        if (qk == 256) q_k_scales(type, b, &ks);
        for (int s = 0; s < qk / 32; s++) {
            __m256 wv[4];
            q_chunk(type, b, s, &ks, wv);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + blk * qk + 32 * s + 8 * i, wv[i]);
        }
    }
}

static void q_row(int type, const uint8_t *row, int k, float *out) {
    switch (type) {
        case SK_Q4_K: q_row_t(SK_Q4_K, row, k, out); break;
        case SK_Q5_K: q_row_t(SK_Q5_K, row, k, out); break;
        default: q_row_t(SK_Q6_K, row, k, out); break;
    }
}

/* R rows x C columns whose weights were dequantized into w (k floats apart): the same lanes and order as
   q_tile (lane i takes inputs 16c + i, c ascending), read from memory instead of dequantized in registers. */
QINLINE void q_tile_f(int R, int C, const float *w, const float *x, int k, float *sums) {
    __m256 acc[3][2][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    for (int e = 0; e < k; e += 16)
        for (int c = 0; c < C; c++) {
            __m256 w0 = _mm256_loadu_ps(w + (size_t)c * k + e), w1 = _mm256_loadu_ps(w + (size_t)c * k + e + 8);
            for (int r = 0; r < R; r++) {
                acc[r][c][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (size_t)r * k + e), acc[r][c][0]);
                acc[r][c][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + (size_t)r * k + e + 8), acc[r][c][1]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r * C + c] = q_tree(acc[r][c][0], acc[r][c][1]);
}

static void q_tile_f_any(int R, int C, const float *w, const float *x, int k, float *sums) {
    switch (R * 8 + C) {
        case 3 * 8 + 2: q_tile_f(3, 2, w, x, k, sums); break;
        case 3 * 8 + 1: q_tile_f(3, 1, w, x, k, sums); break;
        case 2 * 8 + 2: q_tile_f(2, 2, w, x, k, sums); break;
        case 2 * 8 + 1: q_tile_f(2, 1, w, x, k, sums); break;
        case 1 * 8 + 2: q_tile_f(1, 2, w, x, k, sums); break;
        default: q_tile_f(1, 1, w, x, k, sums); break;
    }
}

/* Many rows (a prefill): two columns at a time dequantized once into a buffer for every row of the block,
   then 3 rows x 2 columns per tile. */
static void q_cols_many(int type, const uint8_t *w, long row_bytes, const float *xf, uint16_t *y, int ldy,
                        const float *bias, int r0, int r1, int k, int c0, int c1, const uint16_t *residual, float *buf) {
    float sums[6];
    for (int col = c0; col < c1; col += 2) {
        int C = col + 2 <= c1 ? 2 : 1;
        for (int c = 0; c < C; c++) q_row(type, w + (size_t)(col + c) * row_bytes, k, buf + (size_t)c * k);
        for (int r = r0; r < r1; r += 3) {
            int R = r + 3 <= r1 ? 3 : r1 - r;
            q_tile_f_any(R, C, buf, xf + (size_t)r * k, k, sums);
            for (int i = 0; i < R; i++)
                for (int j = 0; j < C; j++) {
                    size_t at = (size_t)(r + i) * ldy + col + j;
                    y[at] = sk_finish(sums[i * C + j], bias, col + j, residual ? residual + at : NULL);
                }
        }
    }
}

/* From this many rows on, a column is dequantized once into a buffer for all of them (q_cols_many). */
#ifndef Q_MANY
#define Q_MANY 12
#endif

/* Columns c0..c1-1 for every row. Many rows: q_cols_many. Few (a decoding step, a verification): rows 4 at a
   time over one column, its weights dequantized in registers once for the 4; the 1-3 rows left over go over
   several columns at once (1 row: 4 columns, 8 accumulators in flight). */
static void q_cols(int type, const uint8_t *w, long row_bytes, const float *xf, uint16_t *y, int ldy,
                   const float *bias, int m, int k, int c0, int c1, const uint16_t *residual) {
    q_tile_fn tile = q_tiles_for(type);
    float sums[16];
    int rb = sk_row_block(k);
    float *buf = m >= Q_MANY ? aligned_alloc(64, sizeof(float) * 2 * (size_t)k) : NULL;
    for (int r0 = 0; r0 < m; r0 += rb) {
        int r1 = r0 + rb < m ? r0 + rb : m;
        if (buf && r1 - r0 >= Q_MANY) {
            q_cols_many(type, w, row_bytes, xf, y, ldy, bias, r0, r1, k, c0, c1, residual, buf);
            continue;
        }
        int full = r0 + (r1 - r0) / 4 * 4, rest = r1 - full;
        for (int col = c0; col < c1; col++)
            for (int r = r0; r < full; r += 4) {
                tile(4, 1, w + (size_t)col * row_bytes, row_bytes, xf + (size_t)r * k, k, sums);
                for (int i = 0; i < 4; i++) {
                    size_t at = (size_t)(r + i) * ldy + col;
                    y[at] = sk_finish(sums[i], bias, col, residual ? residual + at : NULL);
                }
            }
        if (rest == 0) continue;
        int C = rest == 1 ? 4 : rest == 2 ? 2 : 1, col = c0;
        for (; col < c1; col += C) {
            int cc = col + C <= c1 ? C : 1;
            if (cc == 1 && C > 1) C = 1;  /* the last few columns one at a time */
            tile(rest, cc, w + (size_t)col * row_bytes, row_bytes, xf + (size_t)full * k, k, sums);
            for (int i = 0; i < rest; i++)
                for (int j = 0; j < cc; j++) {
                    size_t at = (size_t)(full + i) * ldy + col + j;
                    y[at] = sk_finish(sums[i * cc + j], bias, col + j, residual ? residual + at : NULL);
                }
        }
    }
    free(buf);
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
    }
}

/* Block b's weights as 32 bytes in input order (unsigned q for all but Q8_0, whose are signed); its scale d
   (and offset m) are the tile's to read. */
QINLINE __m256i q8_weights(int type, const uint8_t *b) {
    if (type == SK_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    int off = type == SK_Q4_0 ? 2 : type == SK_Q4_1 ? 4 : type == SK_Q5_0 ? 6 : 8;
    /* The 16 bytes in both halves, the upper half shifted right by 4 (its 64-bit words: each byte's high
       nibble lands in its own low nibble), then every byte's low nibble: inputs 0-15, then 16-31. */
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + off)));
    __m256i q = _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
    if (type == SK_Q5_0 || type == SK_Q5_1) {
        uint32_t qh;
        memcpy(&qh, b + (type == SK_Q5_0 ? 2 : 4), 4);
        const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        __m256i bits = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf),
                                       _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        bits = _mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1));
        q = _mm256_or_si256(q, _mm256_and_si256(bits, _mm256_set1_epi8(16)));
    }
    return q;
}

#ifndef Q8_AHEAD
#define Q8_AHEAD 2
#endif

/* Lane i of v in every lane. */
QINLINE __m256 q8_lane(__m256 v, int i) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i)); }

/* R rows (from r0) x C columns (w: row_bytes apart) -> sums [R][C], R * C <= 8 (R <= 4, C <= 4; or one row of 8
   columns, a decoding step's tile).

   Per block: each column's weights are unpacked once for the R rows; the R * C scales d * dx come from one
   vector product (lane c * R + r: column c's d times row r's dx, rounded once as quant.h's scalar) and go
   through memory to be broadcast by loads, so that a (row, column) costs one q_dot4 (dot4.h), one conversion
   and one fused multiply-add. Q4_0 and Q5_0 start the integer sum at -8 or -16 times the lane's activation
   sum (x4): the weights' zero point costs nothing per column with VNNI; so does Q8_0's with VNNI, its weights
   taken as w + 128 from -128 times x4. Q4_1 and Q5_1's offsets run as one
   more vector of the same lanes, each the scalar chain o = fma(m, S, o) of its (row, column). The
   accumulators are named variables, slot i = r * C + c, not an array: gcc writes an array of them back to
   the stack at every block. */
QINLINE void q8_tile(int type, int R, int C, const uint8_t *w, long row_bytes, const sk_qrows *xq, int r0, float *sums) {
    const int k = xq->k, nb = k / 32, bytes = sk_q_bytes(type), mp = xq->mp;
    const int offset = type == SK_Q4_1 || type == SK_Q5_1, zeroed = type == SK_Q4_0 || type == SK_Q5_0;
    const int shift = type == SK_Q4_0 ? 3 : 4;
    const int8_t *xrows = xq->q + (size_t)r0 * k;          /* row r, block b: xrows + r * k + 32 b */
    const float *dxt = xq->dt + r0, *st = xq->st + r0;     /* block b, row r: [b * mp + r] */
    const int32_t *x4 = xq->x4 + (size_t)r0 * nb * 8;       /* row r, block b: x4 + (r * nb + b) * 8 */
    const __m256 z = _mm256_setzero_ps();
    __m256 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z, ov = z;
    /* Lane i = c * R + r: its row r (among a block's rows' dx and S) and the places of column c's d and m
       among the columns' [d, m] float16 pairs (2c, 2c + 1). */
    int row_of[8], d_of[8], m_of[8];
    for (int i = 0; i < 8; i++) row_of[i] = i % R, d_of[i] = 2 * ((i / R) % C), m_of[i] = d_of[i] + 1;
    const __m256i lrow = _mm256_loadu_si256((const __m256i *)row_of);
    const __m256i ld = _mm256_loadu_si256((const __m256i *)d_of), lm = _mm256_loadu_si256((const __m256i *)m_of);
    float dd[8] __attribute__((aligned(32)));
    for (int b = 0; b < nb; b++) {
        __m256i wq[8], wa[8], init[4];
        int32_t head[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int c = 0; c < C; c++) {
            const uint8_t *blk = w + c * row_bytes + (size_t)b * bytes;
            /* A column's row is a few cache lines, too short a stream for the hardware prefetcher to learn:
               ask for the columns two tiles ahead. */
            _mm_prefetch((const char *)(blk + Q8_AHEAD * C * row_bytes), _MM_HINT_T0);
            wq[c] = q8_weights(type, blk);
            /* Q8_0's signed weights: as w + 128 (unsigned) where q_dot4 takes any bytes, else their magnitudes
               (the signs go onto the activations). */
            if (type == SK_Q8_0) wa[c] = SK_DOT_ANY_BYTES ? _mm256_xor_si256(wq[c], _mm256_set1_epi8(-128)) : _mm256_abs_epi8(wq[c]);
            memcpy(&head[c], blk, 4);  /* d, and m where the format has one (else two bytes of quants) */
        }
        __m256 pairs = _mm256_cvtph_ps(_mm_setr_epi32(head[0], head[1], head[2], head[3])), dvec, mvec;
        if (C > 4) {
            /* Eight columns' [d, m]: the d's and the m's picked out of both halves, then put in column order. */
            __m256 more = _mm256_cvtph_ps(_mm_setr_epi32(head[4], head[5], head[6], head[7]));
            dvec = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(pairs, more, 0x88)), 0xd8));
            mvec = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(pairs, more, 0xdd)), 0xd8));
        } else {
            dvec = _mm256_permutevar8x32_ps(pairs, ld), mvec = _mm256_permutevar8x32_ps(pairs, lm);
        }
        __m256 rows = _mm256_castps128_ps256(_mm_loadu_ps(dxt + (size_t)b * mp));
        _mm256_store_ps(dd, _mm256_mul_ps(dvec, _mm256_permutevar8x32_ps(rows, lrow)));
        /* Read back by broadcast loads, not shuffles of the register (which gcc prefers, at two shuffles each);
           measured by instruction counts, except Q8_0's one-row tile, which gcc schedules better unfenced. */
        if (type != SK_Q8_0 || R > 1) __asm__ volatile("" ::: "memory");
        if (offset) {
            __m256 sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(st + (size_t)b * mp)), lrow);
            ov = _mm256_fmadd_ps(mvec, sv, ov);
        }
        for (int r = 0; r < R; r++) {
            init[r] = _mm256_setzero_si256();
            if (zeroed || (type == SK_Q8_0 && SK_DOT_ANY_BYTES))
                init[r] = _mm256_sub_epi32(init[r], _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(x4 + ((size_t)r * nb + b) * 8)),
                                                                      type == SK_Q8_0 ? 7 : shift));
        }
#define Q8_SLOT(i)                                                                                                 \
        if (i < R * C) {                                                                                           \
            const int r = i / C, c = i % C;                                                                        \
            __m256i x = _mm256_loadu_si256((const __m256i *)(xrows + (size_t)r * k + 32 * b));                     \
            __m256i i32 = type != SK_Q8_0 || SK_DOT_ANY_BYTES ? q_dot4(init[r], type == SK_Q8_0 ? wa[c] : wq[c], x) \
                                                              : q_dot4(init[r], wa[c], _mm256_sign_epi8(x, wq[c]));  \
            a##i = _mm256_fmadd_ps(_mm256_set1_ps(dd[c * R + r]), _mm256_cvtepi32_ps(i32), a##i);                \
        }
        Q8_SLOT(0) Q8_SLOT(1) Q8_SLOT(2) Q8_SLOT(3) Q8_SLOT(4) Q8_SLOT(5) Q8_SLOT(6) Q8_SLOT(7)
#undef Q8_SLOT
    }
    __m256 all[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    float o[8];
    _mm256_storeu_ps(o, ov);
    for (int i = 0; i < R * C; i++) {
        int r = i / C, c = i % C;
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(all[i]), _mm256_extractf128_ps(all[i], 1));
        __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        sums[r * C + c] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1))) + o[c * R + r];
    }
}

#define Q8_TILES(T)                                                                                           \
    static void q8_tile_##T(int R, int C, const uint8_t *w, long rb, const sk_qrows *xq, int r0, float *s) { \
        switch (R * 8 + C) {                                                                                  \
            case 1 * 8 + 8: q8_tile(T, 1, 8, w, rb, xq, r0, s); break;                                        \
            case 1 * 8 + 4: q8_tile(T, 1, 4, w, rb, xq, r0, s); break;                                        \
            case 4 * 8 + 2: q8_tile(T, 4, 2, w, rb, xq, r0, s); break;                                        \
            case 3 * 8 + 2: q8_tile(T, 3, 2, w, rb, xq, r0, s); break;                                        \
            case 2 * 8 + 2: q8_tile(T, 2, 2, w, rb, xq, r0, s); break;                                        \
            case 1 * 8 + 2: q8_tile(T, 1, 2, w, rb, xq, r0, s); break;                                        \
            case 4 * 8 + 1: q8_tile(T, 4, 1, w, rb, xq, r0, s); break;                                        \
            case 3 * 8 + 1: q8_tile(T, 3, 1, w, rb, xq, r0, s); break;                                        \
            case 2 * 8 + 1: q8_tile(T, 2, 1, w, rb, xq, r0, s); break;                                        \
            default: q8_tile(T, 1, 1, w, rb, xq, r0, s); break;                                               \
        }                                                                                                     \
    }
Q8_TILES(SK_Q4_0)
Q8_TILES(SK_Q4_1)
Q8_TILES(SK_Q5_0)
Q8_TILES(SK_Q5_1)
Q8_TILES(SK_Q8_0)

typedef void (*q8_tile_fn)(int R, int C, const uint8_t *w, long rb, const sk_qrows *xq, int r0, float *s);

/* Columns c0..c1-1 for every row: columns 8 at a time for a lone row, else 2 at a time over rows 4 at a time
   (the weights unpacked once for the rows of a tile); the last columns one at a time. */
static void q8_cols(int type, const uint8_t *w, long row_bytes, const sk_qrows *xq, uint16_t *y, int ldy,
                    const float *bias, int m, int k, int c0, int c1, const uint16_t *residual) {
    (void)k;
    q8_tile_fn tile = type == SK_Q4_0 ? q8_tile_SK_Q4_0 : type == SK_Q4_1 ? q8_tile_SK_Q4_1 : type == SK_Q5_0 ? q8_tile_SK_Q5_0
                    : type == SK_Q5_1 ? q8_tile_SK_Q5_1 : q8_tile_SK_Q8_0;
    float sums[16];
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
