/* The portable kernel: plain C that any gcc target compiles (ARM64 included), and the definition the SIMD
   kernels are tested against bit for bit (see common.h for the arithmetic). */
#include "attention.h"
#include "common.h"
#include "quant.h"

int sk_init(void) { return 1; }

static float sum_squares(const uint16_t *x, int k) { return sk_sum_squares_ref(x, k); }

/* A tile of R rows by C blocks of 16 columns, from row r0 and block blk. Each sum is its own chain of fmaf over
   k in order, as the definition's (so the bits are the same whatever the tile); a tile only keeps R * C * 16
   chains in flight, where one row of one block kept 16, each waiting on the previous fmaf's latency. */
#define SK_TILE(R, C)                                                                                               \
    static void tile_##R##x##C(const uint16_t *w, const float *xf, uint16_t *y, const float *bias, int k, int n,    \
                               int r0, int blk, const uint16_t *residual) {                                        \
        float acc[R][C][16];                                                                                       \
        const uint16_t *wb[C];                                                                                     \
        for (int c = 0; c < C; c++) wb[c] = sk_block(w, k, 16, blk + c);                                           \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C; c++)                                                                            \
                for (int i = 0; i < 16; i++) acc[r][c][i] = 0.0f;                                                  \
        for (int kk = 0; kk < k; kk++) {                                                                           \
            float xv[R];                                                                                           \
            for (int r = 0; r < R; r++) xv[r] = xf[(size_t)(r0 + r) * k + kk];                                    \
            for (int j = 0; j < 16; j++) {                                                                         \
                _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) {                                              \
                    const float wv = sk_bf16_to_f32(wb[c][(size_t)kk * 16 + j]);                                   \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) acc[r][c][j] = fmaf(xv[r], wv, acc[r][c][j]); \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C; c++)                                                                            \
                for (int j = 0; j < 16; j++) {                                                                     \
                    int col = 16 * (blk + c) + (j & 1 ? 8 : 0) + j / 2; /* a block's pairs: columns i and 8 + i */ \
                    size_t at = (size_t)(r0 + r) * n + col;                                                        \
                    y[at] = sk_finish(acc[r][c][j], bias, col, residual ? residual + at : NULL);                   \
                }                                                                                                  \
    }
SK_TILE(2, 2)
SK_TILE(1, 4)
SK_TILE(2, 1)
SK_TILE(1, 2)
SK_TILE(1, 1)
#undef SK_TILE

/* Blocks b0..b1-1 of 16 columns, every row, a span of blocks at a time (every row of it before the next, while
   its weights are in cache): rows two at a time by two blocks (a single row: four blocks). Wider tiles (4 rows)
   compiled to spilled registers and ran slower. */
static void blocks(const uint16_t *w, const float *xf, uint16_t *y, const float *bias, int m, int k, int n, int b0,
                   int b1, const uint16_t *residual) {
    for (int blk = b0; blk < b1;) {
        const int left = b1 - blk;
        int r = 0;
        if (m == 1 && left >= 4) {
            tile_1x4(w, xf, y, bias, k, n, 0, blk, residual);
            blk += 4;
        } else if (left >= 2) {
            for (; r + 2 <= m; r += 2) tile_2x2(w, xf, y, bias, k, n, r, blk, residual);
            if (r < m) tile_1x2(w, xf, y, bias, k, n, r, blk, residual);
            blk += 2;
        } else {
            for (; r + 2 <= m; r += 2) tile_2x1(w, xf, y, bias, k, n, r, blk, residual);
            if (r < m) tile_1x1(w, xf, y, bias, k, n, r, blk, residual);
            blk += 1;
        }
    }
}

void sk_linear(const uint16_t *w, const uint16_t *x, uint16_t *y, const float *bias, int m, int k, int n,
               int threads, int op, const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *scratch) {
    x = sk_prepare_rows(x, m, k, op, norm_w, eps, scratch, sum_squares);
    float *xf = malloc(sizeof(float) * (size_t)m * k);
    sk_widen_rows(x, (size_t)m * k, xf);
    int total = n / 16;
    #pragma omp parallel num_threads(threads) if (threads > 1 && total > 1)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        blocks(w, xf, y, bias, m, k, n, (int)((long)total * t / nt), (int)((long)total * (t + 1) / nt), residual);
    }
    free(xf);
}

/* The attention steps (attention.h's sk_attention_kernel), a row at a time. */
static void keys(int H, const float *const *qs, const int *n, const uint16_t *kc, int d, float scale, float *const *s,
                 int n0, const int32_t *tail, int j0, int j1) {
    for (int r = 0; r < H; r++) {
        const float *qo = qs[r], *qe = qs[r] + d / 2;
        for (int j = j0; j < n[r] && j < j1; j++) {
            const uint16_t *kj = kc + sk_slot(j, n0, tail) * d;
            float l[16] = {0};
            for (int c = 0; c < d / 32; c++)
                for (int i = 0; i < 16; i++) {
                    l[i] = fmaf(qo[16 * c + i], sk_bf16_to_f32(kj[32 * c + 2 * i + 1]), l[i]);
                    l[i] = fmaf(qe[16 * c + i], sk_bf16_to_f32(kj[32 * c + 2 * i]), l[i]);
                }
            s[r][j] = sk_tree16(l) * scale;
        }
    }
}

static float peak(const float *s, int n) {
    float mx = -INFINITY;
    for (int j = 0; j < n; j++) mx = fmaxf(mx, s[j]);
    return mx;
}

static void exps(float *s, int j0, int j1, float mx) {
    for (int j = j0; j < j1; j++) s[j] = sk_exp(s[j] - mx);
}

static float sum(const float *s, int n) {
    float lanes[16] = {0};
    for (int j = 0; j < n; j++) lanes[j % 16] += s[j];
    return 1.0f / sk_tree16(lanes);
}

static void values(int H, float *const *s, const int *n, const uint16_t *vc, int d, const float *inv,
                   uint16_t *const *out, int n0, const int32_t *tail, int d0, int d1) {
    float acc[256];
    for (int r = 0; r < H; r++) {
        for (int i = d0; i < d1; i++) acc[i] = 0.0f;
        for (int j = 0; j < n[r]; j++) {
            const uint16_t *vj = vc + sk_slot(j, n0, tail) * d;
            for (int i = d0; i < d1; i++) acc[i] = fmaf(s[r][j], sk_bf16_to_f32(vj[i]), acc[i]);
        }
        for (int i = d0; i < d1; i++) out[r][i] = sk_f32_to_bf16(acc[i] * inv[r]);
    }
}

static const sk_attention_kernel attention_kernel = {keys, peak, exps, sum, values, 1};

void sk_attention(const part_t *parts, int n_parts, int q_stride, int k_stride, int v_stride, int h, int kv, int d,
                  float scale, int threads) {
    sk_attention_heads(parts, n_parts, q_stride, k_stride, v_stride, h, kv, d, scale, threads, &attention_kernel);
}

void sk_qlinear(int type, const uint8_t *w, long row_bytes, const uint16_t *x, uint16_t *y, int ldy, const float *bias,
                int m, int k, int n, int threads, int op, const uint16_t *norm_w, float eps, const uint16_t *residual,
                uint16_t *scratch) {
    sk_qlinear_frame(type, w, row_bytes, x, y, ldy, bias, m, k, n, threads, op, norm_w, eps, residual, scratch,
                     sum_squares, sk_quantize_row_ref, sk_qlinear_int_ref);
}
