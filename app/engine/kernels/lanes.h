/* The drivers avx2.c and avx512.c share, written once over the width of a float vector (the idea of ggml's
   simd-mappings.h): the column-block tiling of the bf16 products, sk_linear, and attention's steps but the key
   blocks' scores. Each source defines SK_LANES (8: AVX2's __m256, 16: AVX-512's __m512), its helpers (widenN,
   storeN, expN, sum_squares), its tile and rest_tile and, after including this, its keys_rows and row_rest; what
   differs by width is named once below. The arithmetic is the same chain on either width (and the generic
   kernel's), so the bits do not depend on which source runs it. */
#ifndef SPECSERVE_KERNEL_LANES_H
#define SPECSERVE_KERNEL_LANES_H

#include "attention.h"

#if SK_LANES == 16
typedef __m512 sk_vec;
#define sk_vzero _mm512_setzero_ps
#define sk_vset1 _mm512_set1_ps
#define sk_vfma _mm512_fmadd_ps
#define sk_vmul _mm512_mul_ps
#define sk_vadd _mm512_add_ps
#define sk_vsub _mm512_sub_ps
#define sk_vmax _mm512_max_ps
#define sk_vload _mm512_loadu_ps
#define sk_vput _mm512_storeu_ps
#define sk_vexp exp16
#define sk_vwiden widen16
#define sk_vstore store16
/* Attention's values: 4 heads side by side, 64 dimensions a pass (4 registers a head, 16 accumulators). */
#define SK_SIDE 4
#define SK_PASS 64
/* Attention's scores: 4 queries share each block of 16 keys (avx512.c's keys_rows). */
#define SK_SHARE 4
#define SK_KEYS 16
/* 32 registers: a block holds 32 columns (two registers per slot); three rows left over still fit two blocks. */
#define SK_COLS 32
#define SK_REST_BLOCKS(rest) ((rest) == 1 ? 4 : (rest) <= 3 ? 2 : 1)
#elif SK_LANES == 8
typedef __m256 sk_vec;
#define sk_vzero _mm256_setzero_ps
#define sk_vset1 _mm256_set1_ps
#define sk_vfma _mm256_fmadd_ps
#define sk_vmul _mm256_mul_ps
#define sk_vadd _mm256_add_ps
#define sk_vsub _mm256_sub_ps
#define sk_vmax _mm256_max_ps
#define sk_vload _mm256_loadu_ps
#define sk_vput _mm256_storeu_ps
#define sk_vexp exp8
#define sk_vwiden widen8
#define sk_vstore store8
/* Attention's values: 3 heads side by side, 32 dimensions a pass (4 registers a head: 12 accumulators and the 4
   value vectors fill the 16). */
#define SK_SIDE 3
#define SK_PASS 32
/* Attention's scores: 2 queries share each block of 8 keys (avx2.c's keys_rows). */
#define SK_SHARE 2
#define SK_KEYS 8
/* 16 registers: a block holds 16 columns; past 12 accumulators gcc spills, so 3-5 rows left over take one. */
#define SK_COLS 16
#define SK_REST_BLOCKS(rest) ((rest) == 1 ? 4 : (rest) == 2 ? 2 : 1)
#else
#error "SK_LANES must be 8 or 16"
#endif

/* Blocks b0..b1-1 of SK_COLS columns, every row: rows 6 at a time over one block (6 broadcasts and a weight
   load feed 12 fused multiply-adds); of the 1-5 rows left over, one goes over 4 blocks at once and two (three
   on 16 lanes) over 2, so that they still keep 8 accumulators in flight; the rest over one block. */
static void blocks(const uint16_t *w, const float *xf, uint16_t *y, const float *bias, int m, int k, int n, int b0,
                   int b1, const uint16_t *residual) {
    float sums[6 * 4 * SK_COLS];
    int rb = sk_row_block(k);
    for (int r0 = 0; r0 < m; r0 += rb) {
        int r1 = r0 + rb < m ? r0 + rb : m;
        int full = r0 + (r1 - r0) / 6 * 6, rest = r1 - full;
        for (int blk = b0; blk < b1; blk++)
            for (int r = r0; r < full; r += 6) {
                tile(6, 1, w, xf + (size_t)r * k, k, blk, sums);
                sk_finish_tile(sums, 6, SK_COLS, r, SK_COLS * blk, y, bias, n, residual);
            }
        if (rest == 0) continue;
        int B = SK_REST_BLOCKS(rest), blk = b0;
        for (; blk + B <= b1; blk += B) {
            rest_tile(rest, B, w, xf + (size_t)full * k, k, blk, sums);
            sk_finish_tile(sums, rest, B * SK_COLS, full, SK_COLS * blk, y, bias, n, residual);
        }
        for (; blk < b1; blk++) {
            rest_tile(rest, 1, w, xf + (size_t)full * k, k, blk, sums);
            sk_finish_tile(sums, rest, SK_COLS, full, SK_COLS * blk, y, bias, n, residual);
        }
    }
}

void sk_linear(const uint16_t *w, const uint16_t *x, uint16_t *y, const float *bias, int m, int k, int n,
               int threads, int op, const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *scratch) {
    x = sk_prepare_rows(x, m, k, op, norm_w, eps, scratch, sum_squares);
    float *xf = aligned_alloc(64, (sizeof(float) * (size_t)m * k + 63) / 64 * 64);
    sk_widen_rows(x, (size_t)m * k, xf);
    int total = n / SK_COLS;
    #pragma omp parallel num_threads(threads) if (threads > 1 && total > 1)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        blocks(w, xf, y, bias, m, k, n, (int)((long)total * t / nt), (int)((long)total * (t + 1) / nt), residual);
    }
    free(xf);
}

/* The weighted sums of values (common.h: per dimension one fused multiply-add per key, keys in order) of H <= SK_SIDE
   rows that read the same keys (the heads of one kv head, at one position or a run of them; row h over keys
   0..n[h]-1), dimensions d0..d0+W-1 (W = SK_PASS, or 32 for a last half pass): each value vector widened once for
   all of them, H times as many chains in flight. Keys past the fewest rows' last go to the rows that read them
   only (a fused multiply-add by a zero weight could still turn -0 into +0). */
INLINE void values_keys(int H, int W, float *const *s, const int *n, const uint16_t *vc, int d, int d0, int n0,
                        const int32_t *tail, int j0, int j1, int check, sk_vec acc[SK_SIDE][4]) {
    for (int j = j0; j < j1; j++) {
        const uint16_t *vj = vc + sk_slot(j, n0, tail) * d + d0;
        sk_vec v[4];
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) v[b] = b < W / SK_LANES ? sk_vwiden(vj + SK_LANES * b) : sk_vzero();
#pragma GCC unroll 4
        for (int h = 0; h < SK_SIDE; h++) {
            if (h >= H) break;
            if (check && j >= n[h]) continue;
            const sk_vec p = sk_vset1(s[h][j]);
#pragma GCC unroll 4
            for (int b = 0; b < 4; b++)
                if (b < W / SK_LANES) acc[h][b] = sk_vfma(p, v[b], acc[h][b]);
        }
    }
}

/* values_keys over keys ja..jb-1 of every row, the accumulators carried in `carry` ([SK_SIDE][4][SK_LANES]). */
INLINE void values_rows(int H, int W, float *const *s, const int *n, const uint16_t *vc, int d, int d0, int n0,
                        const int32_t *tail, int ja, int jb, float *carry) {
    sk_vec acc[SK_SIDE][4];
#pragma GCC unroll 4
    for (int h = 0; h < SK_SIDE; h++)
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) acc[h][b] = sk_vload(carry + (4 * h + b) * SK_LANES);
    int fewest = n[0], most = n[0];
    for (int h = 1; h < H; h++) {
        fewest = n[h] < fewest ? n[h] : fewest;
        most = n[h] > most ? n[h] : most;
    }
    values_keys(H, W, s, n, vc, d, d0, n0, tail, ja, fewest < jb ? fewest : jb, 0, acc);
    values_keys(H, W, s, n, vc, d, d0, n0, tail, fewest > ja ? fewest : ja, most < jb ? most : jb, 1, acc);
#pragma GCC unroll 4
    for (int h = 0; h < SK_SIDE; h++)
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) sk_vput(carry + (4 * h + b) * SK_LANES, acc[h][b]);
}

/* Bytes of values a block of keys of the weighted sums over more than one pass of dimensions: the passes after
   the first find the block's values in the core's L2 (every pass over every key reads them from memory again
   once they outgrow it), while the blocks stay long enough for the prefetchers' streams. */
#define SK_VALUE_BYTES (256 * 1024)

/* values_rows over dimensions d0..d1-1 (sk_attention_kernel's values): one pass at a time over every key, or
   (more than one pass) the passes in turn over each block of SK_VALUE_BYTES. */
static void values(int H, float *const *s, const int *n, const uint16_t *vc, int d, const float *inv,
                   uint16_t *const *out, int n0, const int32_t *tail, int d0, int d1) {
    float carry[256 / 32 * SK_SIDE * 4 * SK_LANES] __attribute__((aligned(64)));
    const int size = SK_SIDE * 4 * SK_LANES;
    memset(carry, 0, sizeof(float) * (size_t)((d1 - d0 + SK_PASS - 1) / SK_PASS * size));
    int most = n[0];
    for (int h = 1; h < H; h++) most = n[h] > most ? n[h] : most;
    const int block = d1 - d0 > SK_PASS ? SK_VALUE_BYTES / (2 * d) : most;
    for (int ja = 0; ja < most; ja += block)
        for (int dd = d0, p = 0; dd < d1; dd += SK_PASS, p++) {
            if (dd + SK_PASS <= d1)
                values_rows(H, SK_PASS, s, n, vc, d, dd, n0, tail, ja, ja + block, carry + p * size);
            else
                values_rows(H, 32, s, n, vc, d, dd, n0, tail, ja, ja + block, carry + p * size);
        }
    for (int dd = d0, p = 0; dd < d1; dd += SK_PASS, p++)
        for (int h = 0; h < H; h++)
            for (int b = 0; b < (d1 - dd < SK_PASS ? d1 - dd : SK_PASS) / SK_LANES; b++)
                sk_vstore(out[h] + dd + SK_LANES * b, sk_vmul(sk_vload(carry + p * size + (4 * h + b) * SK_LANES),
                                                            sk_vset1(inv[h])));
}

/* The source's own, defined after this: the scores of keys j..j+SK_KEYS-1 for R (2..SK_SHARE) split queries qs
   (odd half, then even half) that read the same keys, into s[r][j..] (keys_rows); one query's keys j..n-1 after
   its shared blocks (j a multiple of SK_KEYS; row_rest). Each key's score is the tree of its own lanes whichever
   of them computes it. */
INLINE void keys_rows(int R, const float *const *qs, int d, const uint16_t *kc, int j, int n0, const int32_t *tail,
                      float scale, float *const *s);
static void row_rest(const float *qo, const float *qe, const uint16_t *kc, int d, int j, int n, float scale, float *s,
                     int n0, const int32_t *tail);

/* sk_attention_kernel's keys: queries SK_SHARE at a time share their common keys' blocks (keys_rows); each then
   its own rest of the range. */
static void keys(int H, const float *const *qs, const int *n, const uint16_t *kc, int d, float scale, float *const *s,
                 int n0, const int32_t *tail, int j0, int j1) {
    for (int h0 = 0; h0 < H; h0 += SK_SHARE) {
        const int R = H - h0 < SK_SHARE ? H - h0 : SK_SHARE;
        int fewest = j1, j = j0;
        for (int r = 0; r < R; r++) fewest = n[h0 + r] < fewest ? n[h0 + r] : fewest;
        if (R > 1)
            for (; j + SK_KEYS <= fewest; j += SK_KEYS) keys_rows(R, qs + h0, d, kc, j, n0, tail, scale, s + h0);
        for (int r = 0; r < R; r++)
            row_rest(qs[h0 + r], qs[h0 + r] + d / 2, kc, d, j, n[h0 + r] < j1 ? n[h0 + r] : j1, scale, s[h0 + r], n0,
                     tail);
    }
}

/* sk_attention_kernel's peak: blocks as vectors, then the rest one at a time (max is exact: the order does not
   matter but for NaN). */
static float peak(const float *s, int n) {
    int j = 0;
    sk_vec mv = sk_vset1(-INFINITY);
    for (; j + SK_LANES <= n; j += SK_LANES) mv = sk_vmax(mv, sk_vload(s + j));
    float m[SK_LANES], mx = -INFINITY;
    sk_vput(m, mv);
    for (int t = 0; t < SK_LANES; t++) mx = fmaxf(mx, m[t]);
    for (; j < n; j++) mx = fmaxf(mx, s[j]);
    return mx;
}

/* sk_attention_kernel's exps (the vector exp is sk_exp's bits). */
static void exps(float *s, int j0, int j1, float mx) {
    const sk_vec m = sk_vset1(mx);
    int j = j0;
    for (; j + SK_LANES <= j1; j += SK_LANES) sk_vput(s + j, sk_vexp(sk_vsub(sk_vload(s + j), m)));
    for (; j < j1; j++) s[j] = sk_exp(s[j] - mx);
}

/* sk_attention_kernel's sum: 16 lanes (16 / SK_LANES vectors) over blocks of 16 keys, then the rest. */
static float sum(const float *s, int n) {
    sk_vec l[16 / SK_LANES];
    for (int b = 0; b < 16 / SK_LANES; b++) l[b] = sk_vzero();
    int j = 0;
    for (; j + 16 <= n; j += 16)
        for (int b = 0; b < 16 / SK_LANES; b++) l[b] = sk_vadd(l[b], sk_vload(s + j + SK_LANES * b));
    float lanes[16];
    for (int b = 0; b < 16 / SK_LANES; b++) sk_vput(lanes + SK_LANES * b, l[b]);
    for (; j < n; j++) lanes[j % 16] += s[j];
    return 1.0f / sk_tree16(lanes);
}

static const sk_attention_kernel attention_kernel = {keys, peak, exps, sum, values, SK_SIDE};

void sk_attention(const part_t *parts, int n_parts, int q_stride, int k_stride, int v_stride, int h, int kv, int d,
                  float scale, int threads) {
    sk_attention_heads(parts, n_parts, q_stride, k_stride, v_stride, h, kv, d, scale, threads, &attention_kernel);
}

#endif
