/* The integer tiles and their column driver, written once over QW, the columns a tile takes in the lanes of one
   vector (as lanes.h for the bf16 products): 8 (__m256i: one x8 group; every AVX2 and AVX-512 kernel) or 16
   (__m512i: two adjacent x8 groups, each vector's halves loaded from both; the AVX-512 kernels with VNNI and
   BW). quant_avx2.h includes it with QW 8, quant_avx512.h with 16; the names it defines end in _8 or _16.
   Lane by lane, both widths take the same operations in the same order: the same bits (quant.h's chain).

   No include guard: included once per width. Before it: quant_avx2.h (q_dot4, q_finish8, sk_qrows). */

#if QW == 8
#define QT(name) name##_8
#define qt_i __m256i
#define qt_f __m256
/* 32 bytes at p (and, at 16 lanes, 32 more at p + G: the next group's same block). */
#define QI_LOAD(p, G) _mm256_loadu_si256((const __m256i *)(p))
#define QI_AND _mm256_and_si256
#define QI_OR _mm256_or_si256
#define QI_XOR _mm256_xor_si256
#define QI_ADD32 _mm256_add_epi32
#define QI_SRLI16 _mm256_srli_epi16
#define QI_SLLI16 _mm256_slli_epi16
#define QI_SRLI32 _mm256_srli_epi32
#define QI_SLLI32 _mm256_slli_epi32
#define QI_SET8 _mm256_set1_epi8
#define QI_SET32 _mm256_set1_epi32
/* a's lanes shifted left by the count at p (an int32). */
#define QI_SLL_AT(a, p) _mm256_sllv_epi32((a), _mm256_set1_epi32(*(p)))
#define QI_MULLO _mm256_mullo_epi32
/* acc + the sums of adjacent 16-bit products of a's lanes and the int32 at p (its two halves) broadcast. */
#define QI_DOT2_AT(acc, a, p) _mm256_add_epi32((acc), _mm256_madd_epi16((a), _mm256_set1_epi32(*(p))))
#define QI_ZERO _mm256_setzero_si256
#define QI_DOT4_AT(acc, W, p) q_dot4((acc), (W), _mm256_set1_epi32(q_load4(p)))
#define QI_ABS8 _mm256_abs_epi8
#define QI_SIGN8 _mm256_sign_epi8
#define QI_PAIRS _mm256_maddubs_epi16
#define QI_ADD16 _mm256_add_epi16
#define QI_WIDEN(acc, p) _mm256_add_epi32((acc), _mm256_madd_epi16((p), _mm256_set1_epi16(1)))
/* 8 bytes at p (and at p + G) widened to a lane each. */
#define QI_U8(p, G) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define QI_I8(p, G) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
/* 8 float16 at p (and at p + G) to float32. */
#define QF_HALF(p, G) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define QF_CVT _mm256_cvtepi32_ps
#define QF_MUL _mm256_mul_ps
#define QF_FMA _mm256_fmadd_ps
#define QF_ADD _mm256_add_ps
#define QF_XOR _mm256_xor_ps
#define QF_SET _mm256_set1_ps
#define QF_ZERO _mm256_setzero_ps
#define QF_STORE _mm256_storeu_ps
#elif QW == 16
#define QT(name) name##_16
#define qt_i __m512i
#define qt_f __m512
#define QI_LOAD(p, G) q16_load((const uint8_t *)(p), (G))
#define QI_AND _mm512_and_si512
#define QI_OR _mm512_or_si512
#define QI_XOR _mm512_xor_si512
#define QI_ADD32 _mm512_add_epi32
#define QI_SRLI16 _mm512_srli_epi16
#define QI_SLLI16 _mm512_slli_epi16
#define QI_SRLI32 _mm512_srli_epi32
#define QI_SLLI32 _mm512_slli_epi32
#define QI_SET8 _mm512_set1_epi8
#define QI_SET32 _mm512_set1_epi32
#define QI_SLL_AT q16_sllv_at
#define QI_MULLO _mm512_mullo_epi32
#define QI_DOT2_AT q16_dot2_at
#define QI_ZERO _mm512_setzero_si512
#define QI_DOT4_AT(acc, W, p) q16_dot4_at((acc), (W), (p))
#define QI_ABS8 _mm512_abs_epi8
#define QI_SIGN8(x, w) _mm512_mask_sub_epi8((x), _mm512_movepi8_mask(w), _mm512_setzero_si512(), (x))
#define QI_PAIRS _mm512_maddubs_epi16
#define QI_ADD16 _mm512_add_epi16
#define QI_WIDEN(acc, p) _mm512_add_epi32((acc), _mm512_madd_epi16((p), _mm512_set1_epi16(1)))
#define QI_U8(p, G) q16_bytes((const uint8_t *)(p), (G), 0)
#define QI_I8(p, G) q16_bytes((const uint8_t *)(p), (G), 1)
#define QF_HALF(p, G) q16_half((const uint8_t *)(p), (G))
#define QF_CVT _mm512_cvtepi32_ps
#define QF_MUL _mm512_mul_ps
#define QF_FMA _mm512_fmadd_ps
#define QF_ADD _mm512_add_ps
/* Without AVX512DQ: the sign flipped by an integer xor. */
#define QF_XOR(a, b) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)))
#define QF_SET _mm512_set1_ps
#define QF_ZERO _mm512_setzero_ps
#define QF_STORE _mm512_storeu_ps
#else
#error "QW must be 8 or 16"
#endif

/* The most rows a tile takes (each block of weights unpacked once for all of them), and whether a tile of R rows
   keeps two integer sums per row (halving each chain of dependent dot4 steps): with AVX-512's 32 vector registers
   8 rows, split up to 4 (8 rows' chains interleave enough); with AVX2's 16, 4 rows, split only for 1-2 (more would
   spill). */
#if defined(__AVX512F__)
#define QT_ROWS 8
#define QT_SPLIT(R) ((R) <= 4)
#else
#define QT_ROWS 4
#define QT_SPLIT(R) ((R) <= 2)
#endif
#ifndef QT_ROW_BLOCK
#define QT_ROW_BLOCK 64
#endif

/* Column c's 4-byte group i of an x8 block in lane c: W_i (inputs 4i..4i+3), from the 4-bit formats' P_(i % 4)
   (low nibbles for i < 4, high for the rest) and, for Q5_*, H's bit i of each byte as the fifth bit (quant.h). */
QINLINE qt_i QT(x8_nibbles)(qt_i P, int i, int five, qt_i H) {
    qt_i q = QI_AND(i < 4 ? P : QI_SRLI16(P, 4), QI_SET8(15));
    if (five) {
        /* Bit 8t + i of each 32-bit lane to bit 8t + 4 (32-bit shifts: the mask drops what crosses a byte). */
        qt_i bit = i < 4 ? QI_SLLI32(H, 4 - i) : i > 4 ? QI_SRLI32(H, i - 4) : H;
        q = QI_OR(q, QI_AND(bit, QI_SET8(16)));
    }
    return q;
}

/* Column c's 4-byte group i of a Q6_K chunk in lane c (inputs 4i..4i+3; 0-63, its zero point 32 the tile's):
   P_(i % 4)'s low or high nibbles under T_(i / 4)'s bits 2u, 2u + 1 (u = i % 4) as bits 4, 5 (quant.h). */
QINLINE qt_i QT(x8_six)(qt_i P, int i, qt_i T) {
    const int u = i % 4;
    qt_i q = QI_AND(i < 4 ? P : QI_SRLI16(P, 4), QI_SET8(15));
    /* 16-bit shifts: the mask drops what crosses a byte. */
    qt_i hi = u < 2 ? QI_SLLI16(T, 4 - 2 * u) : u > 2 ? QI_SRLI16(T, 2 * u - 4) : T;
    return QI_OR(q, QI_AND(hi, QI_SET8(0x30)));
}

/* Without VNNI (q_dot4: VPMADDUBSW, then VPMADDWD to widen its 16-bit pair sums), how many dot4 steps' pair sums
   a tile adds in 16 bits before widening them once: VPMADDUBSW saturates a pair sum to int16, and the sum of n
   steps' stays exact while n * 2 * max|w| * 127 < 2^15: the 4- and 5-bit formats (w <= 31) 4 steps (31,496),
   Q6_K (w <= 63) 2 (32,004), Q8_0 (|w| <= 128, its signs moved to the activations) 1. */
QINLINE int QT(pair_run)(int type) { return type == SK_Q8_0 ? 1 : type == SK_Q6_K ? 2 : 4; }

/* Step i (0-7) of a row's integer sum *sum: the dot4 of the weights Wa with the row's 4 activations at `at`. With
   VNNI one VPDPBUSD; without, VPMADDUBSW's pair sums added into p16 and widened into *sum at the end of each run of
   pair_run steps (Q8_0's activations take the signs of its weights W, Wa their magnitudes). */
QINLINE void QT(dot_step)(int type, qt_i *sum, qt_i *p16, qt_i Wa, qt_i W, const int8_t *at, int i) {
    if (SK_DOT_ANY_BYTES) {
        *sum = QI_DOT4_AT(*sum, Wa, at);
        return;
    }
    const int run = QT(pair_run)(type);
    const qt_i x = QI_SET32(q_load4(at)), pairs = QI_PAIRS(Wa, type == SK_Q8_0 ? QI_SIGN8(x, W) : x);
    *p16 = i % run ? QI_ADD16(*p16, pairs) : pairs;
    if (i % run == run - 1) *sum = QI_WIDEN(*sum, *p16);
}

/* Prefetch: the same block Q8_AHEAD tiles of columns ahead (the rest of this thread's share streams after), by the
   first tile of rows over these columns (`ahead`); the full tiles after it (a prefill's, a verification's past 8
   rows) find those lines fetched, and their prefetches, a loop of them per K-quant chunk, only took issue slots
   from the arithmetic. `ahead` is a constant in every tile (QT_TILES): tested at run time, it cost the K-quants'
   one-row tiles several per cent. At 16 lanes into the core's second-level cache, not the first: a tile of few
   rows reads two groups' streams, and the lines fetched two tiles ahead into the first-level cache pushed out the
   ones it was reading (the default target's one-row step 4.7-5.2 -> 3.2-3.3 ms, docs/bench); at 8 lanes the first,
   where the two measured alike. */
#if QW == 16
#define QT_HINT _MM_HINT_T1
#else
#define QT_HINT _MM_HINT_T0
#endif
QINLINE void QT(x8_ahead)(const uint8_t *p, long row_bytes, int from, int to) {
    for (int h = 0; h < QW / 8; h++)
        for (int line = from; line < to; line += 64)
            _mm_prefetch((const char *)(p + (Q8_AHEAD * QW + 8 * h) * row_bytes + line), QT_HINT);
}

/* A K-quant chunk s's integer scales for the QW columns of the group block at p: SC[0], SC[1], those of its inputs
   0-15 and 16-31 (the chunk's 6-bit scale twice, or Q6_K's two int8 ones); U: the block's top scale bits, moved on
   to the next chunk's. */
QINLINE void QT(kx8_scales)(int six, const uint8_t *p, long G, int s, qt_i *U, qt_i *SC) {
    (void)G;
    if (six) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) SC[h] = QI_I8(p + SK_Q6X8_C + 16 * s + 8 * h, G);
        return;
    }
    const qt_i v = QI_U8(p + SK_KX8_S + 8 * s, G);
    SC[0] = SC[1] = QI_OR(QI_AND(v, QI_SET32(15)), QI_AND(QI_SLLI32(*U, 4), QI_SET32(0x30)));
    *U = QI_SRLI32(*U, 4);
}

/* A Q4_K or Q5_K block's 6-bit minimums for the QW columns of the group block at p, in pairs: MN[j] lane c holds
   column c's minimum of chunk 2j in its low 16 bits and of chunk 2j + 1 in its high 16 (QI_DOT2_AT's operands, against
   sk_qrows' xp). */
QINLINE void QT(kx8_mins)(const uint8_t *p, long G, qt_i *MN) {
    (void)G;
    qt_i U = QI_LOAD(p + SK_KX8_U, G);
    const qt_i top2 = QI_SET32(0x30);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        /* Chunk s's top bits are U's bits 4s + 2, 4s + 3 (U moved on 8 bits a pair). */
        const qt_i lo = QI_OR(QI_SRLI32(QI_U8(p + SK_KX8_S + 16 * j, G), 4), QI_AND(QI_SLLI32(U, 2), top2));
        const qt_i hi = QI_OR(QI_SRLI32(QI_U8(p + SK_KX8_S + 16 * j + 8, G), 4), QI_AND(QI_SRLI32(U, 2), top2));
        MN[j] = QI_OR(lo, QI_SLLI32(hi, 16));
        U = QI_SRLI32(U, 8);
    }
}

/* Rows r..r+R-1 of sums [R][QW] (cc valid columns from col) finished into y (sk_finish: bias, bf16, residual). */
QINLINE void QT(finish_rows)(const float *sums, int R, int cc, int r, int col, uint16_t *y, int ldy, const float *bias,
                             const uint16_t *residual) {
    for (int i = 0; i < R; i++) {
#if QW == 16
        if (cc == 16) {
            const size_t at = (size_t)(r + i) * ldy + col;
            q_finish16(sums + 16 * i, bias ? bias + col : NULL, residual ? residual + at : NULL, y + at);
            continue;
        }
#endif
        for (int h = 0; h < cc; h += 8) {
            const size_t at = (size_t)(r + i) * ldy + col + h;
            const float *s = sums + QW * i + h;
            if (cc - h >= 8) {
                q_finish8(s, bias ? bias + col + h : NULL, residual ? residual + at : NULL, y + at);
                continue;
            }
            for (int j = 0; j < cc - h; j++)
                y[at + j] = sk_finish(s[j], bias, col + h + j, residual ? residual + at + j : NULL);
        }
    }
}

/* R rows (from r0, R <= QT_ROWS) x the QW columns of the x8 group(s) at g (quant.h) -> sums [R][QW]: the 32-input
   formats.

   Per block: each 4-byte group of the columns' weights, one vector (lane c: column c), is unpacked once for
   the R rows and meets each row's 4 activations of that group broadcast, so that a row's integer sums of QW
   columns take 8 dot4 steps and its scaling one conversion, one multiply and one fused multiply-add. The zero
   points (Q4_0's 8, Q5_0's 16; Q8_0's weights taken as w + 128 where q_dot4 takes any bytes) start each sum at
   minus that many times the row's block sum (xz, worked out when the row was quantized; Q8_0's here, see
   sk_q_zero); without VNNI Q8_0's signs move to the activations. The loops
   run unrolled (gcc keeps the accumulators in registers only then). */
QINLINE void QT(x8_tile)(int type, int R, const uint8_t *g, long row_bytes, const sk_qrows *xq, int r0, float *sums,
                         int ahead) {
    const int k = xq->k, nb = k / 32, bytes = sk_q_bytes(type);
    const long G = 8 * row_bytes;  /* the next group (16 lanes) */
    (void)G;
    const int offset = sk_q_offset(type), at_h = sk_x8_high(type), at_q = sk_x8_quants(type);
    const int five = at_h != 0, q8 = type == SK_Q8_0;
    const int zero = q8 ? (SK_DOT_ANY_BYTES ? 128 : 0) : sk_q_zero(type);
    const int8_t *xr = xq->q + (size_t)r0 * k;
    const float *dx = xq->d + (size_t)r0 * nb, *sx = xq->s + (size_t)r0 * nb;
    const int32_t *xz = xq->xz + (size_t)r0 * nb * 2, *xs = xq->xs + (size_t)r0 * nb;
    qt_f acc[QT_ROWS], ov[QT_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < QT_ROWS; r++) acc[r] = ov[r] = QF_ZERO();
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = g + (size_t)b * 8 * bytes;
        if (ahead) QT(x8_ahead)(p, row_bytes, 0, 8 * bytes);
        /* Two integer sums per row (even and odd groups) where QT_SPLIT, added before the conversion. */
        qt_i ia[QT_ROWS], ib[QT_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)r * nb + b;
            ia[r] = !zero ? QI_ZERO() : q8 ? QI_SET32(-zero * xs[at]) : QI_SET32(xz[2 * at]);
            ib[r] = QI_ZERO();
        }
        qt_i H = five ? QI_LOAD(p + at_h, G) : QI_ZERO();
        qt_i p16[QT_ROWS];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            qt_i W = q8 ? QI_LOAD(p + at_q + 32 * i, G) : QT(x8_nibbles)(QI_LOAD(p + at_q + 32 * (i % 4), G), i, five, H);
            qt_i Wa = q8 ? (SK_DOT_ANY_BYTES ? QI_XOR(W, QI_SET8(-128)) : QI_ABS8(W)) : W;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int8_t *at = xr + (size_t)r * k + 32 * b + 4 * i;
                QT(dot_step)(type, QT_SPLIT(R) && i % 2 ? &ib[r] : &ia[r], &p16[r], Wa, W, at, i);
            }
        }
        qt_f d = QF_HALF(p, G);
        qt_f m = offset ? QF_HALF(p + 16, G) : QF_ZERO();
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            qt_f dd = QF_MUL(d, QF_SET(dx[(size_t)r * nb + b]));
            acc[r] = QF_FMA(dd, QF_CVT(QI_ADD32(ia[r], ib[r])), acc[r]);
            if (offset) ov[r] = QF_FMA(m, QF_SET(sx[(size_t)r * nb + b]), ov[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) QF_STORE(sums + QW * r, offset ? QF_ADD(acc[r], ov[r]) : acc[r]);
}

/* The K-quants' tile (Q4_K, Q5_K, Q6_K), as x8_tile: R rows (R <= QT_ROWS) x QW columns -> sums [R][QW].

   Per chunk: the columns' integer scales unpacked from S and U (Q6_K: its two halves' int8 scales), then as
   x8_tile 8 dot4 steps of each 4-byte group unpacked once for the R rows (Q6_K: a sum per half, each started at
   -32 times the row's sum of that half); each row's integer sum of the chunk shifted to its block's step (xe) and
   times the scales, into the row's block sum J: one integer multiply (Q6_K two) where the 32-input formats' chain
   takes a multiply and a fused multiply-add. Per 256-input block then one conversion and one fused multiply-add
   of J per row, and for Q4_K and Q5_K the minimums' N in four 16-bit dot products of pairs and one more. */
QINLINE void QT(kx8_tile)(int type, int R, const uint8_t *g, long row_bytes, const sk_qrows *xq, int r0, float *sums,
                          int ahead) {
    const int k = xq->k, nb = k / 32, bytes = sk_q_bytes(type);
    const long G = 8 * row_bytes;  /* the next group (16 lanes) */
    (void)G;
    const int six = type == SK_Q6_K, five = type == SK_Q5_K, at_h = sk_x8_high(type), at_q = sk_x8_quants(type);
    const int8_t *xr = xq->q + (size_t)r0 * k;
    const float *ux = xq->d + (size_t)r0 * nb;
    const int32_t *xz = xq->xz + (size_t)r0 * nb * 2, *xe = xq->xe + (size_t)r0 * nb;
    const int32_t *xp = xq->xp + (size_t)r0 * (nb / 2);
    qt_f acc[QT_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < QT_ROWS; r++) acc[r] = QF_ZERO();
    for (int blk = 0; blk < k / 256; blk++) {
        const uint8_t *p = g + (size_t)blk * 8 * bytes;
        qt_i U = six ? QI_ZERO() : QI_LOAD(p + SK_KX8_U, G);
        qt_i J[QT_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < QT_ROWS; r++) J[r] = QI_ZERO();
#pragma GCC unroll 1
        for (int s = 0; s < 8; s++) {
            const int b = 8 * blk + s;
            const uint8_t *P = p + at_q + 128 * s;
            /* A quarter of the group block's lines per chunk. */
            if (ahead)
                QT(x8_ahead)(p, row_bytes, 256 * s, 256 * (s + 1) < 8 * bytes ? 256 * (s + 1) : 8 * bytes);
            qt_i SC[2];
            QT(kx8_scales)(six, p, G, s, &U, SC);
            /* Two integer sums per row: Q6_K's halves; the others' even and odd groups where QT_SPLIT, added
               before the shift. */
            qt_i ia[QT_ROWS], ib[QT_ROWS];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int32_t *z = xz + ((size_t)r * nb + b) * 2;
                ia[r] = six ? QI_SET32(z[0]) : QI_ZERO();
                ib[r] = six ? QI_SET32(z[1]) : QI_ZERO();
            }
            const qt_i H = five ? QI_LOAD(p + at_h + 32 * s, G) : QI_ZERO();
            const qt_i T0 = six ? QI_LOAD(p + at_h + 64 * s, G) : QI_ZERO();
            const qt_i T1 = six ? QI_LOAD(p + at_h + 64 * s + 32, G) : QI_ZERO();
            qt_i p16[QT_ROWS];
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                qt_i Pq = QI_LOAD(P + 32 * (i % 4), G);
                qt_i W = six ? QT(x8_six)(Pq, i, i < 4 ? T0 : T1) : QT(x8_nibbles)(Pq, i, five, H);
                const int second = six ? i >= 4 : QT_SPLIT(R) && i % 2;
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    /* (A run of pair sums never crosses Q6_K's halves: 2 divides 4.) */
                    QT(dot_step)(type, second ? &ib[r] : &ia[r], &p16[r], W, W, xr + (size_t)r * k + 32 * b + 4 * i, i);
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int32_t *sh = xe + (size_t)r * nb + b;
                if (six) {
                    J[r] = QI_ADD32(J[r], QI_MULLO(QI_SLL_AT(ia[r], sh), SC[0]));
                    J[r] = QI_ADD32(J[r], QI_MULLO(QI_SLL_AT(ib[r], sh), SC[1]));
                } else {
                    J[r] = QI_ADD32(J[r], QI_MULLO(QI_SLL_AT(QI_ADD32(ia[r], ib[r]), sh), SC[0]));
                }
            }
        }
        const qt_f d = QF_HALF(p, G);
        if (six) {
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                acc[r] = QF_FMA(QF_MUL(d, QF_SET(ux[(size_t)r * nb + 8 * blk])), QF_CVT(J[r]), acc[r]);
            continue;
        }
        const qt_f ndmin = QF_XOR(QF_HALF(p + 16, G), QF_SET(-0.0f));
        qt_i MN[4];
        QT(kx8_mins)(p, G, MN);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const qt_f u = QF_SET(ux[(size_t)r * nb + 8 * blk]);
            const int32_t *pairs = xp + (size_t)r * (nb / 2) + 4 * blk;
            qt_i N = QI_ZERO();
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) N = QI_DOT2_AT(N, MN[j], pairs + j);
            acc[r] = QF_FMA(QF_MUL(d, u), QF_CVT(J[r]), acc[r]);
            acc[r] = QF_FMA(QF_MUL(ndmin, u), QF_CVT(N), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) QF_STORE(sums + QW * r, acc[r]);
}

/* One format's tiles, the format, the row count and whether to prefetch constants in each (a full tile both
   ways). */
#if QT_ROWS == 8
#define QT_WIDE_CASES(T, TILE)                                                                                  \
    case 7: QT(TILE)(T, 7, g, rb, xq, r0, s, 1); break;                                                         \
    case 6: QT(TILE)(T, 6, g, rb, xq, r0, s, 1); break;                                                         \
    case 5: QT(TILE)(T, 5, g, rb, xq, r0, s, 1); break;                                                         \
    case 4: QT(TILE)(T, 4, g, rb, xq, r0, s, 1); break;
#else
#define QT_WIDE_CASES(T, TILE)
#endif
#define QT_TILES(T, TILE)                                                                                       \
    static void QT(tile_##T)(int R, const uint8_t *g, long rb, const sk_qrows *xq, int r0, float *s,            \
                             int ahead) {                                                                       \
        switch (R) {                                                                                            \
            case QT_ROWS:                                                                                       \
                if (ahead)                                                                                      \
                    QT(TILE)(T, QT_ROWS, g, rb, xq, r0, s, 1);                                                  \
                else                                                                                            \
                    QT(TILE)(T, QT_ROWS, g, rb, xq, r0, s, 0);                                                  \
                break;                                                                                          \
            QT_WIDE_CASES(T, TILE)                                                                              \
            case 3: QT(TILE)(T, 3, g, rb, xq, r0, s, 1); break;                                                 \
            case 2: QT(TILE)(T, 2, g, rb, xq, r0, s, 1); break;                                                 \
            default: QT(TILE)(T, 1, g, rb, xq, r0, s, 1); break;                                                \
        }                                                                                                       \
    }
QT_TILES(SK_Q4_0, x8_tile)
QT_TILES(SK_Q4_1, x8_tile)
QT_TILES(SK_Q5_0, x8_tile)
QT_TILES(SK_Q5_1, x8_tile)
QT_TILES(SK_Q8_0, x8_tile)
QT_TILES(SK_Q4_K, kx8_tile)
QT_TILES(SK_Q5_K, kx8_tile)
QT_TILES(SK_Q6_K, kx8_tile)
#undef QT_TILES
#undef QT_WIDE_CASES

/* Rows r0..r1-1 x columns c0..c1-1 (c0 a multiple of 8): QW columns at a time over rows QT_ROWS at a time, the
   columns' weights read again from the cache for each QT_ROWS rows; at 16 lanes a last lone group by the 8-lane
   driver. */
static void QT(q_block)(int type, const uint8_t *w, long row_bytes, const sk_qrows *xq, uint16_t *y, int ldy,
                        const float *bias, int r0, int r1, int c0, int c1, const uint16_t *residual) {
    float sums[QT_ROWS * QW];
    q_tile_fn tile = type == SK_Q4_0 ? QT(tile_SK_Q4_0) : type == SK_Q4_1 ? QT(tile_SK_Q4_1)
                   : type == SK_Q5_0 ? QT(tile_SK_Q5_0) : type == SK_Q5_1 ? QT(tile_SK_Q5_1)
                   : type == SK_Q8_0 ? QT(tile_SK_Q8_0) : type == SK_Q4_K ? QT(tile_SK_Q4_K)
                   : type == SK_Q5_K ? QT(tile_SK_Q5_K) : QT(tile_SK_Q6_K);
    for (int col = c0; col < c1; col += QW) {
        if (QW > 8 && c1 - col <= 8) {
            q_block_8(type, w, row_bytes, xq, y, ldy, bias, r0, r1, col, c1, residual);
            return;
        }
        int cc = c1 - col < QW ? c1 - col : QW;
        for (int r = r0; r < r1; r += QT_ROWS) {
            int R = r + QT_ROWS <= r1 ? QT_ROWS : r1 - r;
            tile(R, w + (size_t)(col / 8) * 8 * row_bytes, row_bytes, xq, r, sums, r == r0);
            QT(finish_rows)(sums, R, cc, r, col, y, ldy, bias, residual);
        }
    }
}

/* Columns c0..c1-1 for every row, QT_ROW_BLOCK rows at a time: a block's quantized rows (k bytes each) stay in the
   core's cache while every column's weights pass over them, where all of a prefill's rows would be read again
   from the shared cache for each QW columns. (The 8-lane one goes unused where 16 lanes drive the products.) */
static __attribute__((unused)) void QT(q_cols)(int type, const uint8_t *w, long row_bytes, const sk_qrows *xq,
                                               uint16_t *y, int ldy, const float *bias, int m, int k, int c0, int c1,
                                               const uint16_t *residual) {
    (void)k;
    for (int r0 = 0; r0 < m; r0 += QT_ROW_BLOCK)
        QT(q_block)(type, w, row_bytes, xq, y, ldy, bias, r0, r0 + QT_ROW_BLOCK < m ? r0 + QT_ROW_BLOCK : m, c0, c1,
                    residual);
}

#undef QT
#undef QT_SPLIT
#undef QT_HINT
#undef QT_ROWS
#undef qt_i
#undef qt_f
#undef QI_LOAD
#undef QI_AND
#undef QI_OR
#undef QI_XOR
#undef QI_ADD32
#undef QI_SRLI16
#undef QI_SLLI16
#undef QI_SRLI32
#undef QI_SLLI32
#undef QI_SET8
#undef QI_SET32
#undef QI_SLL_AT
#undef QI_MULLO
#undef QI_DOT2_AT
#undef QI_ZERO
#undef QI_DOT4_AT
#undef QI_ABS8
#undef QI_SIGN8
#undef QI_PAIRS
#undef QI_ADD16
#undef QI_WIDEN
#undef QI_U8
#undef QI_I8
#undef QF_HALF
#undef QF_CVT
#undef QF_MUL
#undef QF_FMA
#undef QF_ADD
#undef QF_XOR
#undef QF_SET
#undef QF_ZERO
#undef QF_STORE
