/* AVX-512F: Intel Skylake-SP and later, AMD Zen 4 and later. The 16 canonical lanes of common.h are one
   register; bf16 is widened to float32 in registers and multiplied by fused multiply-adds, so every result
   equals the generic kernel's bit for bit. (VDPBF16PS would halve the instructions but flushes denormals,
   so it is not used: the same bits on every kernel matter more here than the compute-bound rows.) */
#include <immintrin.h>
#include "common.h"

#define INLINE static inline __attribute__((always_inline))

int sk_init(void) { return 1; }

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

/* 16 floats -> 16 bf16, rounded to nearest even (NaN kept NaN), as sk_f32_to_bf16. */
INLINE void store16(uint16_t *p, __m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), nan);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

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

/* R rows x C columns of one packed block of 4 (C = 4, or 1 at offset col % 4); see avx2.c. */
INLINE void tile(int R, int C, const uint16_t *w, const float *ro, const float *re, int half, int k, int col,
                 float *sums) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) acc[r][j] = _mm512_setzero_ps();
    const uint16_t *wc = sk_column_chunks(w, k, col);
    for (int c = 0; c < k / 32; c++) {
        const uint16_t *b = wc + (size_t)c * 128;
        for (int j = 0; j < C; j++) {
            __m512i v = load32bf(b + 32 * j);
            __m512 o = odd16(v), e = even16(v);
            for (int r = 0; r < R; r++) {
                const float *xo = ro + (size_t)r * half + 16 * c, *xe = re + (size_t)r * half + 16 * c;
                acc[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xo), o, acc[r][j]);
                acc[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xe), e, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) sums[r * C + j] = tree(acc[r][j]);
}

static void columns(const uint16_t *w, const float *xo, const float *xe, uint16_t *y, const float *bias, int m, int k,
                    int n, int b0, int b1, const uint16_t *residual) {
    const int half = k / 2;
    int rb = (256 * 1024) / (k * 8);
    rb = rb < 4 ? 4 : rb / 4 * 4;
    float sums[16];
    for (int r0 = 0; r0 < m; r0 += rb) {
        int r1 = r0 + rb < m ? r0 + rb : m;
        for (int blk = b0; blk < b1; blk++) {
            int r = r0;
            for (; r + 4 <= r1; r += 4) {
                tile(4, 4, w, xo + (size_t)r * half, xe + (size_t)r * half, half, k, 4 * blk, sums);
                for (int a = 0; a < 4; a++)
                    for (int j = 0; j < 4; j++) {
                        size_t at = (size_t)(r + a) * n + 4 * blk + j;
                        y[at] = sk_finish(sums[a * 4 + j], bias, 4 * blk + j, residual ? residual + at : NULL);
                    }
            }
            for (; r < r1; r++) {
                tile(1, 4, w, xo + (size_t)r * half, xe + (size_t)r * half, half, k, 4 * blk, sums);
                for (int j = 0; j < 4; j++) {
                    size_t at = (size_t)r * n + 4 * blk + j;
                    y[at] = sk_finish(sums[j], bias, 4 * blk + j, residual ? residual + at : NULL);
                }
            }
        }
    }
}

void sk_linear(const uint16_t *w, const uint16_t *x, uint16_t *y, const float *bias, int m, int k, int n,
               int threads, int op, const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *scratch) {
    x = sk_prepare_rows(x, m, k, op, norm_w, eps, scratch, sum_squares);
    const int half = k / 2;
    float *xo = aligned_alloc(64, ((sizeof(float) * ((size_t)m * half * 2 + 16)) + 63) / 64 * 64);
    float *xe = xo + (size_t)m * half;
    for (int r = 0; r < m; r++) sk_split_row(x + (size_t)r * k, k, xo + (size_t)r * half, xe + (size_t)r * half);
    int blocks = n / 4;
    #pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        columns(w, xo, xe, y, bias, m, k, n, (int)((long)blocks * t / nt), (int)((long)blocks * (t + 1) / nt), residual);
    }
    free(xo);
}

INLINE void values(int W, const float *s, int n, const uint16_t *vc, int d, int d0, float inv, uint16_t *out) {
    __m512 acc[4];
    for (int b = 0; b < W / 16; b++) acc[b] = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        __m512 p = _mm512_set1_ps(s[j]);
        const uint16_t *vj = vc + (size_t)j * d + d0;
        for (int b = 0; b < W / 16; b++) acc[b] = _mm512_fmadd_ps(p, widen16(vj + 16 * b), acc[b]);
    }
    __m512 iv = _mm512_set1_ps(inv);
    for (int b = 0; b < W / 16; b++) store16(out + d0 + 16 * b, _mm512_mul_ps(acc[b], iv));
}

static void attend_row(const uint16_t *q, int qpos, const uint16_t *kc, const uint16_t *vc, int d, float scale,
                       uint16_t *out, float *s, float *qo, float *qe) {
    int n = qpos + 1;
    sk_split_row(q, d, qo, qe);
    float mx = -INFINITY;
    for (int j = 0; j < n; j++) {
        const uint16_t *kj = kc + (size_t)j * d;
        __m512 l = _mm512_setzero_ps();
        for (int c = 0; c < d / 32; c++) {
            __m512i v = load32bf(kj + 32 * c);
            l = _mm512_fmadd_ps(_mm512_loadu_ps(qo + 16 * c), odd16(v), l);
            l = _mm512_fmadd_ps(_mm512_loadu_ps(qe + 16 * c), even16(v), l);
        }
        s[j] = tree(l) * scale;
        mx = fmaxf(mx, s[j]);
    }
    __m512 m16 = _mm512_set1_ps(mx), l = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m16));
        _mm512_storeu_ps(s + j, e);
        l = _mm512_add_ps(l, e);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, l);
    for (; j < n; j++) {
        s[j] = sk_exp(s[j] - mx);
        lanes[j % 16] += s[j];
    }
    float inv = 1.0f / sk_tree16(lanes);
    int d0 = 0;
    for (; d0 + 64 <= d; d0 += 64) values(64, s, n, vc, d, d0, inv, out);
    if (d0 < d) values(32, s, n, vc, d, d0, inv, out);
}

void sk_attention(const part_t *parts, int n_parts, int q_stride, int k_stride, int v_stride, int h, int kv, int d,
                  float scale, int threads) {
    int group = h / kv;
    long total = 0;
    long *first = malloc(sizeof(long) * (n_parts + 1));
    int64_t longest = 16;
    for (int p = 0; p < n_parts; p++) {
        sk_write_cache(&parts[p], k_stride, v_stride, kv, d);
        first[p] = total;
        total += parts[p].t * h;
        if (parts[p].start + parts[p].t > longest) longest = parts[p].start + parts[p].t;
    }
    first[n_parts] = total;
    #pragma omp parallel num_threads(threads) if (threads > 1 && total > 1)
    {
        float qo[128] __attribute__((aligned(64))), qe[128] __attribute__((aligned(64)));
        float *s = aligned_alloc(64, (sizeof(float) * (size_t)(longest + 16) + 63) / 64 * 64);
        #pragma omp for schedule(dynamic, 4)
        for (long it = 0; it < total; it++) {
            int p = 0;
            while (first[p + 1] <= it) p++;
            const part_t *pt = &parts[p];
            long local = it - first[p];
            int tt = (int)(local / h), hh = (int)(local % h), g = hh / group;
            attend_row(pt->q + (size_t)tt * q_stride + (size_t)hh * d, (int)(pt->start + tt),
                       pt->kc + (size_t)g * pt->cap * d, pt->vc + (size_t)g * pt->cap * d, d, scale,
                       pt->out + (size_t)tt * h * d + (size_t)hh * d, s, qo, qe);
        }
        free(s);
    }
    free(first);
}
