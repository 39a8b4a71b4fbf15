/* Integer products on AMX-INT8 tiles (Intel Sapphire Rapids and later) for many rows at once: a prefill, a
   verification, a batch. The same arithmetic as quant.h's chain, so the same bits as the generic kernel: a tile
   product gives each (row, column) chunk's exact integer sum I, and the vector units then run the chain on it:
   L = fma(D * dx, (float)I, L) chunk by chunk in order (and the offsets' O in a pass of their own), or the
   K-quants' integer block sums and their fused multiply-adds at each block's end.

   Per 16 columns (two adjacent x8 groups) every chunk's weights are unpacked once, for all rows, into the
   layout a tile's B operand reads: row i of a chunk's B is W_i at 16 lanes (lane c: column c's inputs
   4i..4i+3), which is what quant_tile.h's x8_nibbles/x8_six give, less the format's zero point (Q4_0, Q5_0,
   Q6_K: then signed bytes); the activations' int8 rows are the A operand as they lie. Then per 16 rows and
   chunk one tile product (TDPBSSD for signed weights: Q8_0's and those; TDPBSUD for the others; Q6_K: one per
   16-input half), C stored and run through the chain from memory. Fewer rows than
   QA_MIN_ROWS go to the VNNI tiles (q_cols_16), for which the unpacking is not paid back.

   SK_AMX_TWIN: the tile instructions replaced by plain C of the same meaning, so that this code is checked bit
   for bit on an AVX-512 CPU without AMX (the "amx-twin" stand-in). Needs quant_tile.h at 16 lanes before it. */
#ifndef SPECSERVE_KERNEL_QUANT_AMX_H
#define SPECSERVE_KERNEL_QUANT_AMX_H

#include <sys/syscall.h>
#include <unistd.h>

/* Measured inside whole forwards, where a layer's weights come from L3 or memory rather than the L2 a product
   timed alone reads them from: below about 48 rows the VNNI tiles, which stream the weights once for all rows,
   are ahead of unpacking them for the tiles (docs/bench, AMX tiles from 48 rows). */
#ifndef QA_MIN_ROWS
#define QA_MIN_ROWS 48
#endif

/* Linux hands out AMX tile state only to a process that asks for it. */
static inline int sk_amx_permit(void) {
#if defined(SK_AMX_TWIN)
    return 1;
#else
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#endif
}

/* Tiles 0-3: C (rows x 16 int32); 4, 5: A (rows x depth int8); 6, 7: B (depth / 4 rows x 64 bytes), each in
   turn. depth: the inputs one product takes, 32 (Q6_K: 16). */
#if defined(SK_AMX_TWIN)
static __thread int8_t qa_tile[8][16][64];
static __thread int qa_rows, qa_depth;
static inline void qa_config(int rows, int depth) { qa_rows = rows; qa_depth = depth; }
static inline void qa_release(void) {}
#define QA_ZERO(t) memset(qa_tile[t], 0, sizeof qa_tile[t])
#define QA_LOAD(t, p, stride, rows, bytes)                                                                     \
    for (int qa_r = 0; qa_r < (rows); qa_r++) memcpy(qa_tile[t][qa_r], (const int8_t *)(p) + (size_t)qa_r * (stride), (bytes))
#define QA_LOAD_A(t, p, stride) QA_LOAD(t, p, stride, qa_rows, qa_depth)
#define QA_LOAD_B(t, p) QA_LOAD(t, p, 64, qa_depth / 4, 64)
static inline void qa_dp(int c, int a, int b, int signed_b) {
    for (int m = 0; m < qa_rows; m++)
        for (int n = 0; n < 16; n++) {
            int32_t s;
            memcpy(&s, &qa_tile[c][m][4 * n], 4);
            for (int i = 0; i < qa_depth; i++) {
                int8_t w = qa_tile[b][i / 4][4 * n + i % 4];
                s += (int32_t)qa_tile[a][m][i] * (signed_b ? (int32_t)w : (int32_t)(uint8_t)w);
            }
            memcpy(&qa_tile[c][m][4 * n], &s, 4);
        }
}
#define QA_DP(c, a, b, signed_b) qa_dp(c, a, b, signed_b)
#define QA_STORE(t, p) memcpy((p), qa_tile[t], (size_t)qa_rows * 64)
#else
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} qa_cfg;
static inline void qa_config(int rows, int depth) {
    qa_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) { cfg.rows[t] = (uint8_t)rows; cfg.colsb[t] = 64; }
    for (int t = 4; t < 6; t++) { cfg.rows[t] = (uint8_t)rows; cfg.colsb[t] = (uint16_t)depth; }
    for (int t = 6; t < 8; t++) { cfg.rows[t] = (uint8_t)(depth / 4); cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}
static inline void qa_release(void) { _tile_release(); }
#define QA_ZERO(t) _tile_zero(t)
#define QA_LOAD_A(t, p, stride) _tile_loadd(t, p, stride)
#define QA_LOAD_B(t, p) _tile_loadd(t, p, 64)
#define QA_DP(c, a, b, signed_b)                                                                               \
    do {                                                                                                       \
        if (signed_b) _tile_dpbssd(c, a, b); else _tile_dpbsud(c, a, b);                                       \
    } while (0)
#define QA_STORE(t, p) _tile_stored(t, p, 64)
#endif

/* The 16 columns at g (two x8 groups, the second at g + G) unpacked: for chunk b, B [b][8][64] (the W_i, the
   weights less their zero point as bytes) and D [b][2][16], the scale of inputs 0-15 and of 16-31 (float; the K-quants: their integer
   scales, as int32); M [b][16], a 32-input format's offsets, or per K-quant block d [16], -dmin [16] and the
   minimums' pairs [4][16] (as the tiles': kx8_mins); the same values quant_tile.h's tiles compute. */
static void qa_unpack(int type, const uint8_t *g, long G, int nb, uint8_t *B, float *D, float *M) {
    const int bytes = sk_q_bytes(type), at_h = sk_x8_high(type), at_q = sk_x8_quants(type);
    const int five = at_h != 0, offset = sk_q_offset(type);
    /* A format's zero point comes off the weights here, once per column (q - z fits a signed byte), so that a
       signed tile product gives I + the zero point's term itself: no work per row and chunk in qa_rows16. */
    const __m512i Z = _mm512_set1_epi8((char)sk_q_zero(type));
    if (sk_q_block(type) == 32) {
        for (int b = 0; b < nb; b++) {
            const uint8_t *p = g + (size_t)b * 8 * bytes;
            const __m512i H = five ? q16_load(p + at_h, G) : _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) {
                __m512i W = type == SK_Q8_0 ? q16_load(p + at_q + 32 * i, G)
                                            : x8_nibbles_16(q16_load(p + at_q + 32 * (i % 4), G), i, five, H);
                _mm512_storeu_si512(B + (size_t)b * 512 + 64 * i, _mm512_sub_epi8(W, Z));
            }
            const __m512 d = q16_half(p, G);
            _mm512_storeu_ps(D + (size_t)b * 32, d);
            _mm512_storeu_ps(D + (size_t)b * 32 + 16, d);
            if (offset) _mm512_storeu_ps(M + (size_t)b * 16, q16_half(p + 16, G));
        }
        return;
    }
    const int six = type == SK_Q6_K;
    for (int blk = 0; blk < nb / 8; blk++) {
        const uint8_t *p = g + (size_t)blk * 8 * bytes;
        float *Mb = M + (size_t)blk * 128;
        _mm512_storeu_ps(Mb, q16_half(p, G));
        if (!six) {
            _mm512_storeu_ps(Mb + 16, _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(q16_half(p + 16, G)),
                                                                            _mm512_set1_epi32((int)0x80000000u))));
            __m512i MN[4];
            kx8_mins_16(p, G, MN);
            for (int j = 0; j < 4; j++) _mm512_storeu_si512(Mb + 32 + 16 * j, MN[j]);
        }
        __m512i U = six ? _mm512_setzero_si512() : q16_load(p + SK_KX8_U, G);
        for (int s = 0; s < 8; s++) {
            const int b = 8 * blk + s;
            const uint8_t *P = p + at_q + 128 * s;
            __m512i SC[2];
            kx8_scales_16(six, p, G, s, &U, SC);
            _mm512_storeu_si512(D + (size_t)b * 32, SC[0]);
            _mm512_storeu_si512(D + (size_t)b * 32 + 16, SC[1]);
            const __m512i H = five ? q16_load(p + at_h + 32 * s, G) : _mm512_setzero_si512();
            const __m512i T0 = six ? q16_load(p + at_h + 64 * s, G) : _mm512_setzero_si512();
            const __m512i T1 = six ? q16_load(p + at_h + 64 * s + 32, G) : _mm512_setzero_si512();
            for (int i = 0; i < 8; i++) {
                const __m512i Pq = q16_load(P + 32 * (i % 4), G);
                const __m512i W = six ? x8_six_16(Pq, i, i < 4 ? T0 : T1) : x8_nibbles_16(Pq, i, five, H);
                _mm512_storeu_si512(B + (size_t)b * 512 + 64 * i, _mm512_sub_epi8(W, Z));
            }
        }
    }
}

/* Product u (chunk u / halves, half u % halves) for rows r0.. into C tile c from A tile a and B tile bt (tile
   numbers are immediates, hence macros); then, apart, C tile c stored in slot c of ring. */
#define QA_PRODUCT(c, a, bt, u)                                                                                \
    do {                                                                                                       \
        const int qb = (u) / halves, qh = (u) % halves;                                                        \
        QA_ZERO(c);                                                                                            \
        QA_LOAD_A(a, xr + 32 * qb + depth * qh, k);                                                            \
        QA_LOAD_B(bt, B + (size_t)qb * 512 + 256 * qh);                                                        \
        QA_DP(c, a, bt, sgn);                                                                                  \
    } while (0)
#define QA_ISSUE(u)                                                                                            \
    switch ((u) & 3) {                                                                                         \
        case 0: QA_PRODUCT(0, 4, 6, u); break;                                                                 \
        case 1: QA_PRODUCT(1, 5, 7, u); break;                                                                 \
        case 2: QA_PRODUCT(2, 4, 6, u); break;                                                                 \
        default: QA_PRODUCT(3, 5, 7, u); break;                                                                \
    }
#define QA_KEEP(u)                                                                                             \
    switch ((u) & 3) {                                                                                         \
        case 0: QA_STORE(0, ring[0]); break;                                                                   \
        case 1: QA_STORE(1, ring[1]); break;                                                                   \
        case 2: QA_STORE(2, ring[2]); break;                                                                   \
        default: QA_STORE(3, ring[3]); break;                                                                  \
    }

/* Rows r0..r0+R-1 (R <= 16) x the 16 unpacked columns -> sums [R][16]: each chunk's (half's) tile product
   issued two ahead of its use and stored one ahead (a store waits for its product: apart, neither the tile
   unit nor the vector units wait on the other; four C tiles and ring slots in turn), then per row the chain's
   step, 16 rows' chains side by side: the 32-input formats' L = fma(D * dx, (float)(I + zero point), L) (the
   offsets' chain after); the K-quants' J += scale * ((I + zero point) << xe), and at the end of each 256-input
   block J's (and the minimums') fused multiply-adds. */
static void qa_rows16(int type, int R, const sk_qrows *xq, int r0, const uint8_t *B, const float *D, const float *M,
                      float *sums) {
    const int k = xq->k, nb = k / 32, six = type == SK_Q6_K, halves = six ? 2 : 1, depth = six ? 16 : 32;
    /* Signed weights (Q8_0's, and those whose zero point qa_unpack took off) on signed tiles: the product is I
       with the zero point's term in it. */
    const int sgn = type == SK_Q8_0 || sk_q_zero(type);
    const int units = nb * halves, kq = sk_q_block(type) == 256;
    const int8_t *xr = xq->q + (size_t)r0 * k;
    const float *dx = xq->d + (size_t)r0 * nb;
    int32_t ring[4][256] __attribute__((aligned(64)));
    __m512 acc[16];
    __m512i J[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        acc[r] = _mm512_setzero_ps();
        J[r] = _mm512_setzero_si512();
    }
    QA_ISSUE(0);
    if (units > 1) QA_ISSUE(1);
    QA_KEEP(0);
    for (int u = 0; u < units; u++) {
        if (u + 2 < units) QA_ISSUE(u + 2);
        if (u + 1 < units) QA_KEEP(u + 1);
        const int b = u / halves, h = u % halves;
        const int32_t *Cu = ring[u & 3];
        const __m512 Dh = _mm512_loadu_ps(D + (size_t)b * 32 + 16 * h);
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
            if (r >= R) break;
            const __m512i I = _mm512_load_si512(Cu + 16 * r);
            if (kq) {
                const int32_t *sh = xq->xe + (size_t)(r0 + r) * nb + b;
                J[r] = _mm512_add_epi32(J[r], _mm512_mullo_epi32(q16_sllv_at(I, sh), _mm512_castps_si512(Dh)));
                continue;
            }
            const __m512 dd = _mm512_mul_ps(Dh, _mm512_set1_ps(dx[(size_t)r * nb + b]));
            acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(I), acc[r]);
        }
        if (!kq || b % 8 != 7 || h != halves - 1) continue;
        /* A K-quant block's end (dx: the block's step u). */
        const float *Mb = M + (size_t)(b / 8) * 128;
        const __m512 d = _mm512_loadu_ps(Mb), ndmin = _mm512_loadu_ps(Mb + 16);
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
            if (r >= R) break;
            const __m512 x = _mm512_set1_ps(dx[(size_t)r * nb + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, x), _mm512_cvtepi32_ps(J[r]), acc[r]);
            J[r] = _mm512_setzero_si512();
            if (six) continue;
            const int32_t *pairs = xq->xp + (size_t)(r0 + r) * (nb / 2) + 4 * (b / 8);
            __m512i N = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) N = q16_dot2_at(N, _mm512_loadu_si512(Mb + 32 + 16 * j), pairs + j);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ndmin, x), _mm512_cvtepi32_ps(N), acc[r]);
        }
    }
    if (!sk_q_offset(type) || kq) {
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++)
            if (r < R) _mm512_storeu_ps(sums + 16 * r, acc[r]);
        return;
    }
    const float *sx = xq->s + (size_t)r0 * nb;
    __m512 ov[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) ov[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m512 Mb = _mm512_loadu_ps(M + (size_t)b * 16);
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++)
            if (r < R) ov[r] = _mm512_fmadd_ps(Mb, _mm512_set1_ps(sx[(size_t)r * nb + b]), ov[r]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
        if (r < R) _mm512_storeu_ps(sums + 16 * r, _mm512_add_ps(acc[r], ov[r]));
}
#undef QA_KEEP
#undef QA_ISSUE
#undef QA_PRODUCT

/* Columns c0..c1-1 (c0 a multiple of 8) for every row, as q_cols_16 (its bits): 16 columns at a time on tiles,
   16 rows at a time; a last lone group of 8 and products of few rows by the VNNI tiles. */
static void q_cols_amx(int type, const uint8_t *w, long row_bytes, const sk_qrows *xq, uint16_t *y, int ldy,
                       const float *bias, int m, int k, int c0, int c1, const uint16_t *residual) {
    if (m < QA_MIN_ROWS || c1 - c0 <= 8) {
        q_cols_16(type, w, row_bytes, xq, y, ldy, bias, m, k, c0, c1, residual);
        return;
    }
    const int nb = k / 32, six = type == SK_Q6_K;
    uint8_t *B = aligned_alloc(64, (size_t)nb * (512 + 48 * 4));
    float *D = (float *)(B + (size_t)nb * 512), *M = D + (size_t)nb * 32;
    float sums[16 * 16];
    int configured = 0;
    for (int col = c0; col < c1; col += 16) {
        if (c1 - col <= 8) {
            q_cols_8(type, w, row_bytes, xq, y, ldy, bias, m, k, col, c1, residual);
            break;
        }
        const int cc = c1 - col < 16 ? c1 - col : 16;
        qa_unpack(type, w + (size_t)(col / 8) * 8 * row_bytes, 8 * row_bytes, nb, B, D, M);
        for (int r = 0; r < m; r += 16) {
            const int R = m - r < 16 ? m - r : 16;
            if (R != configured) {
                qa_config(R, six ? 16 : 32);
                configured = R;
            }
            qa_rows16(type, R, xq, r, B, D, M, sums);
            finish_rows_16(sums, R, cc, r, col, y, ldy, bias, residual);
        }
    }
    if (configured) qa_release();
    free(B);
}

#endif
