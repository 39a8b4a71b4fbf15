/* Intel AMX (Sapphire Rapids and later): bf16 products on tiles, 16 rows per tile product, and cached attention
   with scores on tiles. Each output row is the same chain of operations whatever else the call computes, but
   the tile product's own order of additions differs from the portable kernels' (a stated bound, not the same
   bits; see tests/test_kernels.py). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <math.h>
#include <stdlib.h>
#include "common.h"
#include "quant_avx512.h"

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* Linux hands out AMX tile state only to a process that asks for it (quant_amx.h). */
int sk_init(void) { return sk_amx_permit(); }

/* Tiles 0-3: four 16-column blocks of the output (rows x 16 f32); 4: the rows' next 32 inputs; 5-7: weights,
   16 input pairs x 16 columns in the pair-interleaved layout the tile product reads. */
static void configure(int rows) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 5; t++) { cfg.rows[t] = rows; cfg.colsb[t] = 64; }
    for (int t = 5; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

static inline __m512 load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void store16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }

static void store_rows(const float *acc, uint16_t *y, const float *bias, int rows, int n, int col0) {
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < 64; c += 16) {
            __m512 a = _mm512_loadu_ps(acc + r * 64 + c);
            if (bias) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + col0 + c));
            store16(y + (size_t)r * n + col0 + c, a);
        }
    }
}

/* Column groups g0..g1-1 (64 columns each) of y [m, n] = x [m, k] @ w.T (+ bias). */
static void groups(const uint16_t *w, const uint16_t *x, uint16_t *y, const float *bias, int m, int k, int n,
                   int g0, int g1) {
    float acc[16 * 64] __attribute__((aligned(64)));
    const size_t pairs = k / 2, chunks = k / 32, block = pairs * 32;
    int configured = -1;
    /* Groups outer, row tiles inner: a group's weights stay in cache across the row tiles. */
    for (int g = g0; g < g1; g++) {
        const uint16_t *wg = w + (size_t)g * 4 * block;
        for (int m0 = 0; m0 < m; m0 += 16) {
            int rows = m - m0 < 16 ? m - m0 : 16;
            if (rows != configured) { configure(rows); configured = rows; }
            const uint16_t *xa = x + (size_t)m0 * k;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (size_t c = 0; c < chunks; c++) {
                const uint16_t *b = wg + c * 16 * 32;
                _tile_loadd(4, xa + c * 32, k * 2);
                _tile_loadd(5, b, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, b + block, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(7, b + 2 * block, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, b + 3 * block, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, acc, 256);
            _tile_stored(1, acc + 16, 256);
            _tile_stored(2, acc + 32, 256);
            _tile_stored(3, acc + 48, 256);
            store_rows(acc, y + (size_t)m0 * n, bias, rows, n, g * 64);
        }
    }
    _tile_release();
}

/* exp(x) for 16 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial (~1 ulp). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* RMSNorm of each row of x [m, k] into out: x * rsqrt(mean(x^2) + eps) * w, in float32, rounded once. */
static void rmsnorm_rows(const uint16_t *x, const uint16_t *w, float eps, uint16_t *out, int m, int k) {
    for (int r = 0; r < m; r++) {
        const uint16_t *xr = x + (size_t)r * k;
        __m512 ss = _mm512_setzero_ps();
        for (int c = 0; c < k; c += 16) { __m512 v = load16(xr + c); ss = _mm512_fmadd_ps(v, v, ss); }
        float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / k + eps);
        __m512 sv = _mm512_set1_ps(scale);
        for (int c = 0; c < k; c += 16)
            store16(out + (size_t)r * k + c, _mm512_mul_ps(_mm512_mul_ps(load16(xr + c), sv), load16(w + c)));
    }
}

/* SwiGLU of each row of x [m, 2k] = [gate | up] into out [m, k]: silu(gate) * up in float32. */
static void swiglu_rows(const uint16_t *x, uint16_t *out, int m, int k) {
    for (int r = 0; r < m; r++) {
        const uint16_t *g = x + (size_t)r * 2 * k, *u = g + k;
        for (int c = 0; c < k; c += 16) {
            __m512 gv = load16(g + c);
            __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
            __m512 silu = _mm512_div_ps(gv, denom);
            store16(out + (size_t)r * k + c, _mm512_mul_ps(silu, load16(u + c)));
        }
    }
}

/* y [m, n] += residual [m, n] (float32 sum, rounded once); count = m * n is a multiple of 64, as n is. */
static void add_rows(uint16_t *y, const uint16_t *residual, size_t count) {
    for (size_t i = 0; i < count; i += 16) store16(y + i, _mm512_add_ps(load16(y + i), load16(residual + i)));
}

/* w: [n/16][k/2][16][2] bf16 (see AmxLinear); x: [m, k] bf16, or with `op` 1 [m, k] to RMS-normalise with
   norm_w and eps first, or with `op` 2 (3) [m, 2k] = [gate | up] to turn into silu(gate) * up (GeGLU's) first; y: [m, n]
   bf16, plus `residual` [m, n] where given; bias: [n] f32 or NULL. k % 32 == 0, n % 64 == 0. Columns are
   split between threads; each thread configures its own tiles. */
void sk_linear(const uint16_t *w, const uint16_t *x, uint16_t *y, const float *bias, int m, int k, int n,
                int threads, int op, const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *scratch) {
    if (op == 1) { rmsnorm_rows(x, norm_w, eps, scratch, m, k); x = scratch; }
    else if (op == 2) { swiglu_rows(x, scratch, m, k); x = scratch; }
    else if (op == 3) x = sk_prepare_rows(x, m, k, op, NULL, 0.0f, scratch, NULL);  /* GeGLU: rare, scalar */
    int total = n / 64;
    if (threads <= 1 || total < 2) {
        groups(w, x, y, bias, m, k, n, 0, total);
    } else {
        #pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            groups(w, x, y, bias, m, k, n, (int)((long)total * t / nt), (int)((long)total * (t + 1) / nt));
        }
    }
    if (residual) add_rows(y, residual, (size_t)m * n);
}

static void config_keys(int rows) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.rows[0] = rows; cfg.colsb[0] = 64;   /* C: keys x 16 queries f32 */
    cfg.rows[1] = rows; cfg.colsb[1] = 64;   /* A: keys x 32 dims bf16 */
    cfg.rows[2] = 16; cfg.colsb[2] = 64;     /* B: 16 dim pairs x 16 queries x 2 */
    cfg.rows[3] = 16; cfg.colsb[3] = 64;
    _tile_loadconfig(&cfg);
}

/* Scores of key tile b (keys 16b.., as many rows as configured) against the packed queries qt, into s. */
static inline void score_tile(const uint16_t *k, const uint16_t *qt, int d, int b, float *s) {
    _tile_zero(0);
    for (int c = 0; c < d / 32; c++) {
        _tile_loadd(1, k + (size_t)b * 16 * d + c * 32, d * 2);
        _tile_loadd(2, qt + c * 16 * 32, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, s + b * 256, 64);
}

/* One block of up to 16 query rows (all of one kv head), D % 32 == 0, D <= 256.
   qpos[r]: position of query r (it sees keys 0..qpos[r]); n = max(qpos) + 1 keys are read. */
static void block(const uint16_t *const *qrows, const int *qpos, int nq, const uint16_t *k, const uint16_t *v,
                  int d, float scale, uint16_t *const *outs, float *s /* [n_pad][16] */) {
    int n = 0;
    for (int r = 0; r < nq; r++) if (qpos[r] + 1 > n) n = qpos[r] + 1;
    /* Q^T packed for the tile product: [d/2 pairs][16 queries][2]. */
    uint16_t qt[128 * 16 * 2] __attribute__((aligned(64)));
    memset(qt, 0, sizeof(uint16_t) * (d / 2) * 32);
    for (int r = 0; r < nq; r++)
        for (int p = 0; p < d / 2; p++) {
            qt[(p * 16 + r) * 2] = qrows[r][2 * p];
            qt[(p * 16 + r) * 2 + 1] = qrows[r][2 * p + 1];
        }
    /* Scores S^T [keys][16 queries] = K Q^T, 16 keys per tile (the last tile as many as are left). */
    int full = n / 16, rest = n % 16;
    if (full) {
        config_keys(16);
        for (int b = 0; b < full; b++) score_tile(k, qt, d, b, s);
    }
    if (rest) {
        config_keys(rest);
        score_tile(k, qt, d, full, s);
    }
    _tile_release();
    /* Softmax down each query's column, keys past its position masked; 16 queries per vector. */
    __m512i pos = _mm512_set1_epi32(-1);
    int qp[16];
    for (int r = 0; r < 16; r++) qp[r] = r < nq ? qpos[r] : -1;
    pos = _mm512_loadu_si512(qp);
    __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx = ninf;
    for (int j = 0; j < n; j++) {
        __mmask16 live = _mm512_cmp_epi32_mask(_mm512_set1_epi32(j), pos, _MM_CMPINT_LE);
        __m512 x = _mm512_mask_mov_ps(ninf, live, _mm512_mul_ps(_mm512_loadu_ps(s + j * 16), sc));
        _mm512_storeu_ps(s + j * 16, x);
        mx = _mm512_max_ps(mx, x);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j * 16), mx));
        __mmask16 live = _mm512_cmp_epi32_mask(_mm512_set1_epi32(j), pos, _MM_CMPINT_LE);
        e = _mm512_maskz_mov_ps(live, e);
        _mm512_storeu_ps(s + j * 16, e);
        sum = _mm512_add_ps(sum, e);
    }
    float sums[16];
    _mm512_storeu_ps(sums, sum);
    /* O = P V in float32, keys in order: 4 query rows at a time, 64 dims per pass. */
    for (int r0 = 0; r0 < nq; r0 += 4) {
        int rr = nq - r0 < 4 ? nq - r0 : 4;
        for (int d0 = 0; d0 < d; d0 += 64) {
            __m512 acc[4][4];
            for (int a = 0; a < 4; a++) for (int b = 0; b < 4; b++) acc[a][b] = _mm512_setzero_ps();
            int nmax = 0;
            for (int a = 0; a < rr; a++) if (qpos[r0 + a] + 1 > nmax) nmax = qpos[r0 + a] + 1;
            for (int j = 0; j < nmax; j++) {
                const uint16_t *vj = v + (size_t)j * d + d0;
                __m512 v0 = load16(vj), v1 = load16(vj + 16), v2 = load16(vj + 32), v3 = load16(vj + 48);
                for (int a = 0; a < rr; a++) {
                    __m512 p = _mm512_set1_ps(s[j * 16 + r0 + a]);
                    acc[a][0] = _mm512_fmadd_ps(p, v0, acc[a][0]);
                    acc[a][1] = _mm512_fmadd_ps(p, v1, acc[a][1]);
                    acc[a][2] = _mm512_fmadd_ps(p, v2, acc[a][2]);
                    acc[a][3] = _mm512_fmadd_ps(p, v3, acc[a][3]);
                }
            }
            for (int a = 0; a < rr; a++) {
                __m512 inv = _mm512_set1_ps(1.0f / sums[r0 + a]);
                for (int b = 0; b < 4; b++) store16(outs[r0 + a] + d0 + 16 * b, _mm512_mul_ps(acc[a][b], inv));
            }
        }
    }
}


/* Causal attention for several sequences in one call: each part's new keys and values are written into its
   cache at start..start+t-1, then query row (t, h) of a part attends its keys 0..start+t with kv head
   h / (h / kv). Work items (part, kv head, 16 query rows) are shared among the threads. */
void sk_attention(const part_t *parts, int n_parts, int q_stride, int k_stride, int v_stride, int h, int kv, int d,
                   float scale, int threads) {
    int group = h / kv, total = 0, first[n_parts + 1];
    for (int p = 0; p < n_parts; p++) {
        const part_t *pt = &parts[p];
        for (int tt = 0; tt < pt->t; tt++)
            for (int g = 0; g < kv; g++) {
                size_t slot = ((size_t)g * pt->cap + pt->start + tt) * d;
                memcpy(pt->kc + slot, pt->k + (size_t)tt * k_stride + (size_t)g * d, (size_t)d * 2);
                memcpy(pt->vc + slot, pt->v + (size_t)tt * v_stride + (size_t)g * d, (size_t)d * 2);
            }
        first[p] = total;
        total += kv * (int)((pt->t * group + 15) / 16);
    }
    first[n_parts] = total;
    #pragma omp parallel for num_threads(threads) schedule(dynamic) if (threads > 1 && total > 1)
    for (int it = 0; it < total; it++) {
        int p = 0;
        while (first[p + 1] <= it) p++;
        const part_t *pt = &parts[p];
        int rows = (int)pt->t * group, blocks = (rows + 15) / 16, local = it - first[p];
        int g = local / blocks, b0 = (local % blocks) * 16, nq = rows - b0 < 16 ? rows - b0 : 16;
        const uint16_t *qrows[16];
        uint16_t *outs[16];
        int qpos[16];
        for (int r = 0; r < nq; r++) {
            int row = b0 + r, tt = row / group, hh = g * group + row % group;
            qrows[r] = pt->q + (size_t)tt * q_stride + (size_t)hh * d;
            outs[r] = pt->out + (size_t)tt * h * d + (size_t)hh * d;
            qpos[r] = (int)pt->start + tt;
        }
        size_t n_pad = (size_t)(pt->start + pt->t + 15) / 16 * 16;
        float *s = aligned_alloc(64, n_pad * 16 * sizeof(float));
        block(qrows, qpos, nq, pt->kc + (size_t)g * pt->cap * d, pt->vc + (size_t)g * pt->cap * d, d, scale, outs, s);
        free(s);
    }
}

/* Quantized weights: quant_avx512.h's tiles, many rows on AMX-INT8 (quant_amx.h; the generic bits, as on avx2). */
void sk_qlinear(int type, const uint8_t *w, long row_bytes, const uint16_t *x, uint16_t *y, int ldy, const float *bias,
                int m, int k, int n, int threads, int op, const uint16_t *norm_w, float eps, const uint16_t *residual,
                uint16_t *scratch) {
    sk_qlinear_frame(type, w, row_bytes, x, y, ldy, bias, m, k, n, threads, op, norm_w, eps, residual, scratch,
                     sk_sum_squares_ref, q8_quantize_row, q_cols);
}
