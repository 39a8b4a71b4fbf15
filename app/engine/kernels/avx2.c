/* AVX2 + FMA: any x86-64 server of the last decade. bf16 is widened to float32 in registers (no bf16
   arithmetic on these CPUs); the 16 canonical lanes of common.h are two 8-lane registers, so every result
   equals the generic kernel's bit for bit. Products stream each weight once per call for all rows. */
#include <immintrin.h>
#include "common.h"
#include "quant_avx2.h"

#define INLINE static inline __attribute__((always_inline))

int sk_init(void) { return 1; }

INLINE __m256 odd8(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }
INLINE __m256 even8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
INLINE __m256i load16bf(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The lane tree's last three levels (i + i+4, i + i+2, i + i+1) over s8, lanes i + i+8. */
INLINE float tree8(__m256 s8) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* The lane tree of two 8-lane halves (lanes 0-7, 8-15). */
INLINE float tree(__m256 lo, __m256 hi) { return tree8(_mm256_add_ps(lo, hi)); }

/* 8 floats -> 8 bf16 at p (quant_avx2.h's q_bf16x8: rounded to nearest even, NaN kept NaN). */
INLINE void store8(uint16_t *p, __m256 f) { _mm_storeu_si128((__m128i *)p, q_bf16x8(f)); }

/* sk_exp on 8 floats. */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(SK_EXP_LO)), _mm256_set1_ps(SK_EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(SK_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SK_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SK_LN2_LO), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static float sum_squares(const uint16_t *x, int k) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int j = 0; j < k; j += 16) {
        __m256 a = widen8(x + j), b = widen8(x + j + 8);
        lo = _mm256_fmadd_ps(a, a, lo);
        hi = _mm256_fmadd_ps(b, b, hi);
    }
    return tree(lo, hi);
}

/* R rows x B blocks of 16 columns (blocks blk..blk+B-1), every input in order; R * B <= 6 (R * B * 2
   accumulators, the lone row's 8 enough to keep the multiply-adds in flight). Sums into
   out [R][B * 16]. The accumulators are named variables, slot i = r * B + b, not an array: gcc writes an
   array of them back to the stack at every input, even where it also keeps them in registers. */
INLINE void tile(int R, int B, const uint16_t *w, const float *x, int k, int blk, float *out) {
    const __m256 z = _mm256_setzero_ps();
    __m256 l0 = z, h0 = z, l1 = z, h1 = z, l2 = z, h2 = z, l3 = z, h3 = z, l4 = z, h4 = z, l5 = z, h5 = z;
    const uint16_t *wb = sk_block(w, k, 16, blk);
    const size_t stride = (size_t)k * 16;
    for (int kk = 0; kk < k; kk++) {
        __m256 lo[4], hi[4];
        for (int b = 0; b < B; b++) {
            __m256i v = load16bf(wb + b * stride + (size_t)kk * 16);
            lo[b] = even8(v), hi[b] = odd8(v);
        }
#define SLOT(i)                                                                             \
    if (i < R * B) {                                                                        \
        __m256 xb = _mm256_broadcast_ss(x + (size_t)(i / B) * k + kk);                      \
        l##i = _mm256_fmadd_ps(xb, lo[i % B], l##i);                                        \
        h##i = _mm256_fmadd_ps(xb, hi[i % B], h##i);                                        \
    }
        SLOT(0) SLOT(1) SLOT(2) SLOT(3) SLOT(4) SLOT(5)
#undef SLOT
    }
    /* Slot i holds row i / B, block i % B: out [R][B * 16] is slot order. */
    __m256 all[12] = {l0, h0, l1, h1, l2, h2, l3, h3, l4, h4, l5, h5};
    for (int i = 0; i < R * B; i++) {
        _mm256_storeu_ps(out + i * 16, all[2 * i]);
        _mm256_storeu_ps(out + i * 16 + 8, all[2 * i + 1]);
    }
}

/* The rows r..r+R-1 (R = 1-5) over blocks blk..blk+B-1. */
static void rest_tile(int R, int B, const uint16_t *w, const float *x, int k, int blk, float *sums) {
    switch (R * 8 + B) {
        case 1 * 8 + 4: tile(1, 4, w, x, k, blk, sums); break;
        case 1 * 8 + 1: tile(1, 1, w, x, k, blk, sums); break;
        case 2 * 8 + 2: tile(2, 2, w, x, k, blk, sums); break;
        case 2 * 8 + 1: tile(2, 1, w, x, k, blk, sums); break;
        case 3 * 8 + 1: tile(3, 1, w, x, k, blk, sums); break;
        case 4 * 8 + 1: tile(4, 1, w, x, k, blk, sums); break;
        default: tile(5, 1, w, x, k, blk, sums); break;
    }
}

#define SK_LANES 8
#include "lanes.h"

/* tree8x8's first level for keys 2p, 2p+1 (a0, a1: their lanes i + i+8): i + i+4 in the low and high half. */
INLINE __m256 tree2(__m256 a0, __m256 a1) {
    return _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
}

/* tree8x8's last levels over tree2 of keys 0-1, 2-3, 4-5, 6-7 (b[0..3]). */
INLINE __m256 tree_last(const __m256 *b) {
    __m256 c[2];
#pragma GCC unroll 2
    for (int p = 0; p < 2; p++)  /* half h: keys 4p + h (lanes 0, 1), 4p + 2 + h (lanes 2, 3): i + i+2 */
        c[p] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * p], b[2 * p + 1], 0x44), _mm256_shuffle_ps(b[2 * p], b[2 * p + 1], 0xee));
    /* half h: keys h, 2 + h, 4 + h, 6 + h: i + i+1 */
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xdd));
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* tree() of 8 keys at once: a[t] is key t's lanes i + i+8 (i < 8); lane t of the result is its score's sum, by
   the tree's own additions (i + i+4, i + i+2, i + i+1), pairing two vectors' halves at each level. */
INLINE __m256 tree8x8(const __m256 *a) {
    __m256 b[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) b[p] = tree2(a[2 * p], a[2 * p + 1]);
    return tree_last(b);
}

/* One key's lanes i + i+8 (i < 8): its score before the tree's last three levels. */
INLINE __m256 key_lanes(const float *qo, const float *qe, const uint16_t *kj, int d) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int c = 0; c < d / 32; c++) {
        __m256i vlo = load16bf(kj + 32 * c), vhi = load16bf(kj + 32 * c + 16);
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(qo + 16 * c), odd8(vlo), lo);
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(qe + 16 * c), even8(vlo), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(qo + 16 * c + 8), odd8(vhi), hi);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(qe + 16 * c + 8), even8(vhi), hi);
    }
    return _mm256_add_ps(lo, hi);
}

/* Scores of keys j..j+7 for two rows that read the same keys (split rows qs[0], qs[1]: odd half then even half)
   into s[r][j..j+7]: two keys at a time, each key's vectors loaded and split once for both rows, the rows' first
   tree level taken before the next two keys. */
INLINE void keys8_rows2(const float *const *qs, int d, const uint16_t *kc, int j, int n0, const int32_t *tail,
                        __m256 sv, float *const *s) {
    __m256 b[2][4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        __m256 lo[2][2], hi[2][2];
        const uint16_t *kj[2];
#pragma GCC unroll 2
        for (int t = 0; t < 2; t++) {
            kj[t] = kc + sk_slot(j + 2 * p + t, n0, tail) * d;
            lo[0][t] = hi[0][t] = lo[1][t] = hi[1][t] = _mm256_setzero_ps();
        }
        for (int c = 0; c < d / 32; c++) {
#pragma GCC unroll 2
            for (int t = 0; t < 2; t++) {
                const __m256i vlo = load16bf(kj[t] + 32 * c), vhi = load16bf(kj[t] + 32 * c + 16);
                const __m256 ol = odd8(vlo), el = even8(vlo), oh = odd8(vhi), eh = even8(vhi);
#pragma GCC unroll 2
                for (int r = 0; r < 2; r++) {
                    const float *qo = qs[r] + 16 * c, *qe = qs[r] + d / 2 + 16 * c;
                    lo[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(qe), el, _mm256_fmadd_ps(_mm256_loadu_ps(qo), ol, lo[r][t]));
                    hi[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(qe + 8), eh, _mm256_fmadd_ps(_mm256_loadu_ps(qo + 8), oh, hi[r][t]));
                }
            }
        }
#pragma GCC unroll 2
        for (int r = 0; r < 2; r++)
            b[r][p] = tree2(_mm256_add_ps(lo[r][0], hi[r][0]), _mm256_add_ps(lo[r][1], hi[r][1]));
    }
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++) _mm256_storeu_ps(s[r] + j, _mm256_mul_ps(tree_last(b[r]), sv));
}

/* Keys j..n-1 of one row (j a multiple of 8) after its shared blocks: 8 at a time, then one at a time. */
static void row_rest(const float *qo, const float *qe, const uint16_t *kc, int d, int j, int n, float scale, float *s,
                     int n0, const int32_t *tail) {
    const __m256 sv = _mm256_set1_ps(scale);
    for (; j + 8 <= n; j += 8) {
        __m256 a[8];
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) a[t] = key_lanes(qo, qe, kc + sk_slot(j + t, n0, tail) * d, d);
        _mm256_storeu_ps(s + j, _mm256_mul_ps(tree8x8(a), sv));
    }
    for (; j < n; j++) s[j] = tree8(key_lanes(qo, qe, kc + sk_slot(j, n0, tail) * d, d)) * scale;
}

/* keys_rows (lanes.h): SK_SHARE is 2, so R is. */
INLINE void keys_rows(int R, const float *const *qs, int d, const uint16_t *kc, int j, int n0, const int32_t *tail,
                      float scale, float *const *s) {
    (void)R;
    keys8_rows2(qs, d, kc, j, n0, tail, _mm256_set1_ps(scale), s);
}

/* Quantized weights: the AVX2 tiles of quant_avx2.h. */
void sk_qlinear(int type, const uint8_t *w, long row_bytes, const uint16_t *x, uint16_t *y, int ldy, const float *bias,
                int m, int k, int n, int threads, int op, const uint16_t *norm_w, float eps, const uint16_t *residual,
                uint16_t *scratch) {
    sk_qlinear_frame(type, w, row_bytes, x, y, ldy, bias, m, k, n, threads, op, norm_w, eps, residual, scratch,
                     sum_squares, q8_quantize_row, q_cols_8);
}
