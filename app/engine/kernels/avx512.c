/* AVX-512F: Intel Skylake-SP and later, AMD Zen 4 and later. The 16 canonical lanes of common.h are one
   register; bf16 is widened to float32 in registers and multiplied by fused multiply-adds, so every result
   equals the generic kernel's bit for bit. (VDPBF16PS would halve the instructions but flushes denormals,
   so it is not used: the same bits on every kernel matter more here than the compute-bound rows.) */
#include <immintrin.h>
#include "common.h"
#include "quant_avx512.h"

#define INLINE static inline __attribute__((always_inline))

#if defined(__AMX_INT8__) || defined(SK_AMX_TWIN)
int sk_init(void) { return sk_amx_permit(); }
#else
int sk_init(void) { return 1; }
#endif

INLINE __m512 odd16(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))); }
INLINE __m512 even16(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
INLINE __m512i load32bf(const uint16_t *p) { return _mm512_loadu_si512((const void *)p); }
INLINE __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The lane tree: i + i+8, i + i+4, i + i+2, i + i+1. */
INLINE float tree(__m512 l) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(l), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(l), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* tree16x16's first two levels for keys 4p..4p+3 (l: their 4 vectors): i + i+8 pairing two keys' halves, then
   i + i+4 pairing two pairs' quarters; 128-bit chunk c of the result holds key 4p + c's four sums. */
INLINE __m512 tree4(const __m512 *l) {
    const __m512 h0 = _mm512_add_ps(_mm512_shuffle_f32x4(l[0], l[1], 0x44), _mm512_shuffle_f32x4(l[0], l[1], 0xee));
    const __m512 h1 = _mm512_add_ps(_mm512_shuffle_f32x4(l[2], l[3], 0x44), _mm512_shuffle_f32x4(l[2], l[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(h0, h1, 0x88), _mm512_shuffle_f32x4(h0, h1, 0xdd));
}

/* tree16x16's last two levels over tree4 of keys 0-3, 4-7, 8-11, 12-15 (q[0..3]). */
INLINE __m512 tree_last(const __m512 *q) {
    __m512 r[2];
#pragma GCC unroll 2
    for (int p = 0; p < 2; p++)  /* chunk c: keys 8p + c (lanes 0, 1) and 8p + 4 + c (lanes 2, 3) */
        r[p] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * p], q[2 * p + 1], 0x44), _mm512_shuffle_ps(q[2 * p], q[2 * p + 1], 0xee));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xdd));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
}

/* tree() of 16 vectors at once: lane t of the result is tree(l[t]), by the same additions (i + i+8, i + i+4,
   i + i+2, i + i+1), four levels of pairing two vectors' halves: after them lane 4c + e holds key c + 4e. */
INLINE __m512 tree16x16(const __m512 *l) {
    __m512 q[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) q[p] = tree4(l + 4 * p);
    return tree_last(q);
}

/* 16 floats -> 16 bf16, rounded to nearest even (NaN kept NaN), as sk_f32_to_bf16 (quant_avx512.h). */
INLINE void store16(uint16_t *p, __m512 f) { _mm256_storeu_si256((__m256i *)p, q_bf16x16(f)); }

/* sk_exp on 16 floats. */
INLINE __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(SK_EXP_LO)), _mm512_set1_ps(SK_EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(SK_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(SK_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(SK_LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

static float sum_squares(const uint16_t *x, int k) {
    __m512 l = _mm512_setzero_ps();
    for (int j = 0; j < k; j += 16) {
        __m512 a = widen16(x + j);
        l = _mm512_fmadd_ps(a, a, l);
    }
    return tree(l);
}

/* R rows x B blocks of 32 columns (blocks blk..blk+B-1), every input in order; R * B <= 6. Sums into
   out [R][B * 32]. */
INLINE void tile(int R, int B, const uint16_t *w, const float *x, int k, int blk, float *out) {
    __m512 acc[6][4][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b][0] = acc[r][b][1] = _mm512_setzero_ps();
    const uint16_t *wb = sk_block(w, k, 32, blk);
    const size_t stride = (size_t)k * 32;
    for (int kk = 0; kk < k; kk++) {
        for (int b = 0; b < B; b++) {
            __m512i v = load32bf(wb + b * stride + (size_t)kk * 32);
            __m512 lo = even16(v), hi = odd16(v);
            for (int r = 0; r < R; r++) {
                __m512 xb = _mm512_set1_ps(x[(size_t)r * k + kk]);
                acc[r][b][0] = _mm512_fmadd_ps(xb, lo, acc[r][b][0]);
                acc[r][b][1] = _mm512_fmadd_ps(xb, hi, acc[r][b][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) {
            _mm512_storeu_ps(out + r * B * 32 + b * 32, acc[r][b][0]);
            _mm512_storeu_ps(out + r * B * 32 + b * 32 + 16, acc[r][b][1]);
        }
}

static void rest_tile(int R, int B, const uint16_t *w, const float *x, int k, int blk, float *sums) {
    switch (R * 8 + B) {
        case 1 * 8 + 4: tile(1, 4, w, x, k, blk, sums); break;
        case 1 * 8 + 1: tile(1, 1, w, x, k, blk, sums); break;
        case 2 * 8 + 2: tile(2, 2, w, x, k, blk, sums); break;
        case 2 * 8 + 1: tile(2, 1, w, x, k, blk, sums); break;
        case 3 * 8 + 2: tile(3, 2, w, x, k, blk, sums); break;
        case 3 * 8 + 1: tile(3, 1, w, x, k, blk, sums); break;
        case 4 * 8 + 1: tile(4, 1, w, x, k, blk, sums); break;
        default: tile(5, 1, w, x, k, blk, sums); break;
    }
}

#define SK_LANES 16
#include "lanes.h"

/* One key's lanes (a query row split, qo and qe): its score before the tree. */
INLINE __m512 key_lanes(const float *qo, const float *qe, const uint16_t *kj, int d) {
    __m512 l = _mm512_setzero_ps();
    for (int c = 0; c < d / 32; c++) {
        __m512i v = load32bf(kj + 32 * c);
        l = _mm512_fmadd_ps(_mm512_loadu_ps(qo + 16 * c), odd16(v), l);
        l = _mm512_fmadd_ps(_mm512_loadu_ps(qe + 16 * c), even16(v), l);
    }
    return l;
}

/* Scores of keys j..j+15 for one query row (split: qo, qe) into s[j..j+15]: their lane sums reduced together
   (tree16x16), each by the tree's own additions. */
INLINE __m512 keys16(const float *qo, const float *qe, const uint16_t *kc, int d, int j, int n0, const int32_t *tail,
                     __m512 sv, float *s) {
    __m512 l[16];
    const uint16_t *kj[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) {
        kj[t] = kc + sk_slot(j + t, n0, tail) * d;
        l[t] = _mm512_setzero_ps();
    }
    for (int c = 0; c < d / 32; c++) {
        const __m512 o = _mm512_loadu_ps(qo + 16 * c), e = _mm512_loadu_ps(qe + 16 * c);
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) {
            const __m512i v = load32bf(kj[t] + 32 * c);
            l[t] = _mm512_fmadd_ps(e, even16(v), _mm512_fmadd_ps(o, odd16(v), l[t]));
        }
    }
    const __m512 sc = _mm512_mul_ps(tree16x16(l), sv);
    _mm512_storeu_ps(s + j, sc);
    return sc;
}

/* keys16 for R (2-4) rows that read the same keys: 4 keys at a time, each key's vector loaded and split once for
   the R rows (4R accumulators), its rows' first two tree levels taken before the next 4 keys. */
INLINE void keys16_rows(int R, const float *const *qs, int d, const uint16_t *kc, int j, int n0, const int32_t *tail,
                        __m512 sv, float *const *s) {
    __m512 q[4][4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        __m512 l[4][4];
        const uint16_t *kj[4];
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            kj[t] = kc + sk_slot(j + 4 * p + t, n0, tail) * d;
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) l[r][t] = _mm512_setzero_ps();
        }
        for (int c = 0; c < d / 32; c++) {
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const __m512i v = load32bf(kj[t] + 32 * c);
                const __m512 o = odd16(v), e = even16(v);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    l[r][t] = _mm512_fmadd_ps(_mm512_loadu_ps(qs[r] + d / 2 + 16 * c), e,
                                              _mm512_fmadd_ps(_mm512_loadu_ps(qs[r] + 16 * c), o, l[r][t]));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) q[r][p] = tree4(l[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm512_storeu_ps(s[r] + j, _mm512_mul_ps(tree_last(q[r]), sv));
}

/* Keys j..n-1 of one row (j a multiple of 16) after its shared blocks: 16 at a time, then one at a time. */
static void row_rest(const float *qo, const float *qe, const uint16_t *kc, int d, int j, int n, float scale, float *s,
                     int n0, const int32_t *tail) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (; j + 16 <= n; j += 16) keys16(qo, qe, kc, d, j, n0, tail, sv, s);
    for (; j < n; j++) s[j] = tree(key_lanes(qo, qe, kc + sk_slot(j, n0, tail) * d, d)) * scale;
}

/* keys_rows (lanes.h): keys16_rows at the row count. */
INLINE void keys_rows(int R, const float *const *qs, int d, const uint16_t *kc, int j, int n0, const int32_t *tail,
                      float scale, float *const *s) {
    const __m512 sv = _mm512_set1_ps(scale);
    switch (R) {
        case 2: keys16_rows(2, qs, d, kc, j, n0, tail, sv, s); break;
        case 3: keys16_rows(3, qs, d, kc, j, n0, tail, sv, s); break;
        default: keys16_rows(4, qs, d, kc, j, n0, tail, sv, s); break;
    }
}

/* Quantized weights: quant_avx512.h's tiles, 16 columns at a time where the build has VNNI and BW (the generic bits, as on avx2). */
void sk_qlinear(int type, const uint8_t *w, long row_bytes, const uint16_t *x, uint16_t *y, int ldy, const float *bias,
                int m, int k, int n, int threads, int op, const uint16_t *norm_w, float eps, const uint16_t *residual,
                uint16_t *scratch) {
    sk_qlinear_frame(type, w, row_bytes, x, y, ldy, bias, m, k, n, threads, op, norm_w, eps, residual, scratch,
                     sum_squares, q8_quantize_row, q_cols);
}
