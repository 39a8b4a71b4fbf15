/* The drivers avx2.c and avx512.c share, written once over the width of a float vector (the idea of ggml's
   simd-mappings.h): the column-block tiling of the bf16 products and sk_linear. Each source defines SK_LANES
   (8: AVX2's __m256, 16: AVX-512's __m512), its sum_squares, tile and rest_tile, then includes this; what
   differs by width is named once below. The arithmetic is the same chain on either width (and the generic
   kernel's), so the bits do not depend on which source runs it. */
#ifndef SPECSERVE_KERNEL_LANES_H
#define SPECSERVE_KERNEL_LANES_H

#if SK_LANES == 16
/* 32 registers: a block holds 32 columns (two registers per slot); three rows left over still fit two blocks. */
#define SK_COLS 32
#define SK_REST_BLOCKS(rest) ((rest) == 1 ? 4 : (rest) <= 3 ? 2 : 1)
#elif SK_LANES == 8
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

#endif
