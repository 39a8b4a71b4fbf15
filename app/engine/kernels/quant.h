/* Products on GGUF quantized weights (llama.cpp's blocks, 8 rows' interleaved at load: sk_q_pack), and the scalar
   definitions every kernel computes bit for bit.

   A weight row (one output) is k / QK blocks of its format, QK = 32 or 256 inputs per block. Every format
   takes integer products (below): the activations are quantized to 8 bits (per 32 inputs; for the K-quants per
   256 with power-of-two steps per 32) and meet the weights' integers in exact integer dot products, scaled in
   float32. A weight's value, its integer times its scale plus its offset (sk_q_ints_ref, sk_kblock), is the one
   the `gguf` package's (and llama.cpp's) dequantization gives, up to that dequantization's own rounding (at most
   one: Q4_1, Q5_1 and the K-quants' offsets, Q6_K's scale). */
#ifndef SPECSERVE_KERNEL_QUANT_H
#define SPECSERVE_KERNEL_QUANT_H

#include "common.h"

/* GGML's type ids of the formats with a kernel. */
enum { SK_Q4_0 = 2, SK_Q4_1 = 3, SK_Q5_0 = 6, SK_Q5_1 = 7, SK_Q8_0 = 8, SK_Q4_K = 12, SK_Q5_K = 13, SK_Q6_K = 14 };

/* Inputs per block (QK) and bytes per block of a format; 0 for a format without a kernel. */
static inline int sk_q_block(int type) {
    return type == SK_Q4_K || type == SK_Q5_K || type == SK_Q6_K ? 256 : type == SK_Q4_0 || type == SK_Q4_1 ||
           type == SK_Q5_0 || type == SK_Q5_1 || type == SK_Q8_0 ? 32 : 0;
}

static inline int sk_q_bytes(int type) {
    switch (type) {
        case SK_Q4_0: return 18;
        case SK_Q4_1: return 20;
        case SK_Q5_0: return 22;
        case SK_Q5_1: return 24;
        case SK_Q8_0: return 34;
        case SK_Q4_K: return 144;
        case SK_Q5_K: return 176;
        case SK_Q6_K: return 210;
        default: return 0;
    }
}

/* IEEE half -> float32, exact (subnormals included). */
static inline float sk_f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f;  /* man * 2^-24: zero or a subnormal half, exact */
        return sign ? -f : f;
    }
    u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The K-quants' 6-bit scale and minimum of sub-block j (0-7) from their 12 packed bytes. */
static inline void sk_k_scale_min(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* sk_qlinear: y [m, ldy] columns 0..n-1 = x [m, k] @ w.T (+ bias [n]), w [n] rows of `row_bytes` bytes of
   format `type`, as sk_q_pack lays them out; op, norm_w, eps, residual ([m, ldy], as y) and scratch as
   sk_linear. */
void sk_qlinear(int type, const uint8_t *w, long row_bytes, const uint16_t *x, uint16_t *y, int ldy, const float *bias,
                int m, int k, int n, int threads, int op, const uint16_t *norm_w, float eps, const uint16_t *residual,
                uint16_t *scratch);

/* Integer products (every format): as llama.cpp's vec_dot_q4_1_q8_1 and vec_dot_q4_K_q8_K, the activations are
   quantized too, per row, and the weights' integers meet them in exact integer dot products. Fixed so that a
   result depends on nothing but its own row and column:
   - activations (bf16, widened exactly), per block of QA inputs of a row (QA = 32 for the 32-input formats, 256
     for the K-quants: sk_q_act): amax = max |x_i| over the block, dx = amax / 127, id = 1 / dx (0 where dx is 0);
     per 32 inputs b of it (a chunk) e_b, the largest of 0-3 with amax_b * 2^e_b <= amax (amax_b: the chunk's max
     |x_i|; always 0 where QA is 32), xq_i = x_i * (id * 2^e_b) rounded to the nearest integer (ties to even), in
     [-127, 127]: the chunk's step is dx / 2^e_b, a power of two below the block's, so a chunk of small values
     keeps its digits while the K-quants' chunk sums stay integers on one step, dx / 8 (each shifted left by
     3 - e_b); xs_b = sum of the chunk's xq_i, S_b = dx * (float)xs_b (the 32-input formats);
   - weights as integers w_i per 32 inputs (a whole block of the 32-input formats, a chunk of a K-quant's): Q4_0
     q - 8, Q5_0 q - 16, Q8_0 q, Q4_1 and Q5_1 q, Q4_K and Q5_K q, Q6_K q - 32;
   - the 32-input formats: one float32 sum L per output takes, block by block in order, I = sum_{i<32} w_i xq_i
     (an exact integer, |I| < 2^20) by one fused multiply-add L = fma(d * dx, (float)I, L) (d: the block's
     float16 scale; d * dx rounded once); Q4_1 and Q5_1 keep one more float, O = fma(m, S_b, O) block by block
     (m: their float16 offset), and the result is L + O (L for the others);
   - the K-quants, per 256-input block in order, in integers up to its end: Q4_K and Q5_K take J = sum_s sc_s *
     (I_s << (3 - e_s)) over their 8 chunks s (sc_s the 6-bit scale, I_s as above) and N = sum_s mn_s * (xs_s <<
     (3 - e_s)) (mn_s the 6-bit minimum), then L = fma(d * u, (float)J, L) and L = fma(-dmin * u, (float)N, L) with
     u = dx / 8 (d, dmin float16; each product rounded once); Q6_K takes J = sum_t sc_t * (I_t << (3 - e)) over its
     16 halves t (16 inputs each, sc_t its int8 scale, I_t = sum_{i in t} w_i xq_i, e its chunk's), then L =
     fma(d * u, (float)J, L). The integers are exact (|J| < 2^31, |N| < 2^24; (float)J rounds to nearest) and the
     result is L. Which order integers are added in is free (they are exact): a tile takes 8 columns' I at once
     in the lanes of one vector (the x8 layout below);
   - then bias, bf16 rounding and residual as sk_finish.
   The values multiplied are the weights' exact values and xq_i * dx / 2^e_b: the oracle of the tests. */
static inline int sk_q_int(int type) { return sk_q_block(type) != 0; }

/* Whether a format's chunks have an offset M (and its chain O). */
static inline int sk_q_offset(int type) {
    return type == SK_Q4_1 || type == SK_Q5_1 || type == SK_Q4_K || type == SK_Q5_K;
}

/* The activations' block QA of a format: 32, or 256 for the K-quants (quant.h's definition above). */
static inline int sk_q_act(int type) { return sk_q_block(type) == 256 ? 256 : 32; }

/* Quantized activation rows: xq [m][k], and per row and 32 inputs (chunk) b: d [m][k / 32], the step of the
   chunk's integer sums as the tiles take them (dx; the K-quants' dx / 8, their sums shifted left by xe), S [m][k /
   32] (S_b) and xs [m][k / 32], the sum of the chunk's xq (what Q4_0, Q5_0 and Q8_0's zero points subtract 8, 16 or
   128 times); xe [m][k / 32]: 3 - e_b, the left shift of a K-quant chunk's integer sums (0 where qa is 32); xh [m][k
   / 32][2]: the sums of xq over each half chunk (what Q6_K's subtracts 32 times); xz [m][k / 32][2]: each chunk's
   (Q6_K: each half's) sum times minus its zero point (sk_q_zero), where a SIMD tile starts its integer sums (a
   broadcast from memory: no integer work per row in the tile); xp [m][k / 64]: the K-quants' xs of chunks 2j and
   2j + 1, each shifted by its xe, as the low and high 16 bits of one word (the pairs a 16-bit dot product takes to
   the minimums). xz and xp: sk_qrows_terms. qa: the inputs that share a dx (sk_q_act). One allocation, freed by
   sk_qrows_free. */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *xh, *xs, *xz, *xe, *xp;
    int k, qa;
} sk_qrows;

static inline sk_qrows sk_qrows_alloc(int m, int k, int qa) {
    size_t nb = (size_t)(k / 32), blocks = (size_t)m * nb, pairs = (size_t)m * (nb / 2);
    size_t bytes = (size_t)m * k + blocks * (8 + 24) + pairs * 4;
    uint8_t *p = aligned_alloc(64, (bytes + 127) / 64 * 64 + 64);
    sk_qrows r;
    r.xh = (int32_t *)p;
    r.xz = r.xh + blocks * 2;
    r.xs = r.xz + blocks * 2;
    r.xe = r.xs + blocks;
    r.xp = r.xe + blocks;
    r.d = (float *)(r.xp + pairs);
    r.s = r.d + blocks;
    r.q = (int8_t *)(r.s + blocks);
    r.k = k;
    r.qa = qa;
    return r;
}

static inline void sk_qrows_free(sk_qrows *r) { free(r->xh); }

/* A chunk's e (0-3; the definition above) from its largest magnitude and its block's: exact comparisons. */
static inline int sk_q_step(float amax_chunk, float amax) {
    int e = 0;
    while (e < 3 && amax_chunk * (float)(2 << e) <= amax) e++;
    return e;
}

/* Chunk b's fields of row r beside its xq: xh (its halves' sums h0, h1), xs, S, d and xe, for a block whose dx is
   dx and the chunk's e. */
static inline void sk_qrows_chunk(const sk_qrows *rows, int r, int b, float dx, int e, int32_t h0, int32_t h1) {
    const size_t at = (size_t)r * (rows->k / 32) + b;
    rows->xh[2 * at] = h0;
    rows->xh[2 * at + 1] = h1;
    rows->xs[at] = h0 + h1;
    rows->s[at] = dx * (float)(h0 + h1);
    rows->d[at] = rows->qa == 256 ? dx * 0.125f : dx;
    rows->xe[at] = rows->qa == 256 ? 3 - e : 0;
}

/* Row r of x (bf16, k inputs) -> its quantized form in rows (the definition above). */
static inline void sk_quantize_row_ref(const uint16_t *x, const sk_qrows *rows, int r) {
    const int k = rows->k, per = rows->qa / 32;
    for (int a = 0; a < k / 32; a += per) {
        float amax = 0.0f, chunk[8];
        for (int b = 0; b < per; b++) {
            chunk[b] = 0.0f;
            /* A comparison, not fmaxf (the same value: |x| is never -0 and a NaN is passed over either way): gcc 12's
               aarch64 vectoriser fails on fmaxf's reduction at -O3 (an internal compiler error). */
            for (int i = 32 * (a + b); i < 32 * (a + b + 1); i++) {
                const float v = fabsf(sk_bf16_to_f32(x[i]));
                chunk[b] = v > chunk[b] ? v : chunk[b];
            }
            amax = fmaxf(amax, chunk[b]);
        }
        const float dx = amax / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
        for (int b = a; b < a + per; b++) {
            const int e = per > 1 ? sk_q_step(chunk[b - a], amax) : 0;
            const float ide = id * (float)(1 << e);
            int8_t *q = rows->q + (size_t)r * k + 32 * b;
            int32_t h[2] = {0, 0};
            for (int i = 0; i < 32; i++) {
                q[i] = (int8_t)nearbyintf(sk_bf16_to_f32(x[32 * b + i]) * ide);
                h[i / 16] += q[i];
            }
            sk_qrows_chunk(rows, r, b, dx, e, h[0], h[1]);
        }
    }
}

/* The zero point a SIMD tile takes off a chunk's integer sum from xz (as minus it times the activations' sum):
   Q4_0 8, Q5_0 16, Q6_K 32 (per half); 0 otherwise (Q8_0's 128 where the kernel's dot4 takes any bytes is worked
   out in its tile: its weights take twice the 4-bit formats' loads, and one more from memory cost it more than the
   integer work it saves). */
static inline int sk_q_zero(int type) { return type == SK_Q4_0 ? 8 : type == SK_Q5_0 ? 16 : type == SK_Q6_K ? 32 : 0; }

/* Row r's xz and xp for format type (after the rest of its fields). */
static inline void sk_qrows_terms(int type, const sk_qrows *rows, int r) {
    const int zero = sk_q_zero(type), nb = rows->k / 32;
    if (rows->qa == 256 && type != SK_Q6_K) {
        const int32_t *xs = rows->xs + (size_t)r * nb, *xe = rows->xe + (size_t)r * nb;
        for (int j = 0; j < nb / 2; j++) {
            const uint32_t lo = (uint32_t)(xs[2 * j] * (1 << xe[2 * j]));
            const uint32_t hi = (uint32_t)(xs[2 * j + 1] * (1 << xe[2 * j + 1]));
            rows->xp[(size_t)r * (nb / 2) + j] = (int32_t)((lo & 0xffffu) | hi << 16);
        }
    }
    if (!zero) return;
    int32_t *z = rows->xz + (size_t)r * nb * 2;
    for (int b = 0; b < nb; b++) {
        const int32_t *h = rows->xh + ((size_t)r * nb + b) * 2;
        z[2 * b] = -zero * (type == SK_Q6_K ? h[0] : rows->xs[(size_t)r * nb + b]);
        z[2 * b + 1] = type == SK_Q6_K ? -zero * h[1] : 0;
    }
}

/* A 32-input format's block as integers w[32], its scale d and its offset m (0 without one). */
static inline void sk_q_ints_ref(int type, const uint8_t *b, int *w, float *d, float *m) {
    *d = sk_f16_to_f32(b);
    *m = type == SK_Q4_1 || type == SK_Q5_1 ? sk_f16_to_f32(b + 2) : 0.0f;
    if (type == SK_Q8_0) {
        for (int j = 0; j < 32; j++) w[j] = (int8_t)b[2 + j];
        return;
    }
    int five = type == SK_Q5_0 || type == SK_Q5_1, off, zero = sk_q_zero(type);
    uint32_t qh = 0;
    if (five) {
        const uint8_t *h = b + (type == SK_Q5_0 ? 2 : 4);
        qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
        off = type == SK_Q5_0 ? 6 : 8;
    } else {
        off = type == SK_Q4_0 ? 2 : 4;
    }
    for (int j = 0; j < 16; j++) {
        w[j] = (b[off + j] & 15) | (int)((qh >> j) & 1) << 4;
        w[16 + j] = (b[off + j] >> 4) | (int)((qh >> (16 + j)) & 1) << 4;
        w[j] -= zero;
        w[16 + j] -= zero;
    }
}

/* The x8 layout, which sk_qlinear takes for every format: the rows (columns of the output) in groups of 8, a
   group's blocks in order, block b of the group's 8 columns as 8 * bytes bytes (the group's GGUF blocks,
   rearranged), so that a tile reads 8 columns' block in one pass and finds in each 32-byte vector lane c =
   column c (4 bytes of it). The 32-input formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
   - d [8] (float16; offset 0), then m [8] for Q4_1 and Q5_1 (offset 16);
   - Q5_0 and Q5_1: H [8] (32 bits each), bit 8t + i of H_c the fifth bit of column c's input 4i + t;
   - Q4_*, Q5_*: P [4][8][4]: P_q lane c is column c's quant bytes 4q..4q+3, whose low nibbles are its inputs
     4q..4q+3 and high nibbles its inputs 16 + 4q..16 + 4q + 3; Q8_0: W [8][8][4]: W_i lane c is column c's
     quants 4i..4i+3.
   The K-quants (256 inputs, 8 chunks of 32; "input i of chunk s" below), each chunk's quants as the 4-bit
   formats' P [4][8][4] (low 4 bits; one P per chunk, last):
   - Q4_K and Q5_K: d [8], dmin [8] (float16; offsets 0, 16); S [8][8] (offset 32): byte S_sc, the low 4 bits of
     column c's chunk s scale, under the low 4 of its minimum; U [8] (offset 96, 32 bits each): bits 4s, 4s + 1
     of U_c the top 2 bits of chunk s's scale, 4s + 2, 4s + 3 of its minimum; Q5_K: H [8][8] (offset 128, 32 bits
     each): chunk s's fifth bits as Q5_0's H; P [8][4][8][4] (offset 128, Q5_K 384);
   - Q6_K: d [8] (float16); C [16][8] (offset 16): the int8 scale of half t (chunk t / 2's first or second 16
     inputs) of column c; T [8][2][8][4] (offset 144): T_sv lane c byte j, bits 2u, 2u + 1: the top 2 bits of
     chunk s's input 16v + 4u + j; P [8][4][8][4] (offset 656).
   The same bytes as the file's (8 * bytes per group block), every bit of them used. A group past the last row
   holds zeros. */

/* Where a group block's parts start: its quants (P, or Q8_0's W), and the bits beside them (Q5_*'s H, Q6_K's T;
   0: none); the K-quants' S and U, Q6_K's C. */
enum { SK_KX8_S = 32, SK_KX8_U = 96, SK_Q6X8_C = 16 };

static inline int sk_x8_high(int type) {
    return type == SK_Q5_0 ? 16 : type == SK_Q5_1 ? 32 : type == SK_Q5_K ? 128 : type == SK_Q6_K ? 144 : 0;
}

static inline int sk_x8_quants(int type) {
    if (type == SK_Q6_K) return 656;
    if (sk_q_block(type) == 256) return type == SK_Q5_K ? 384 : 128;
    return 16 * (1 + sk_q_offset(type)) + 32 * (sk_x8_high(type) != 0);
}

/* The `width` bits at `shift` of byte *at <-> *v (write: into the byte; else out of it). */
static inline void sk_bits(uint8_t *at, int shift, int width, int *v, int write) {
    const int mask = (1 << width) - 1;
    if (write)
        *at = (uint8_t)((*at & ~(mask << shift)) | ((*v & mask) << shift));
    else
        *v = (*at >> shift) & mask;
}

/* A value of lo + hi bits kept in two places: its low `lo` bits at (a, sa), the rest at (b, sb). */
static inline void sk_bits2(uint8_t *a, int sa, int lo, uint8_t *b, int sb, int hi, int *v, int write) {
    int low = write ? *v & ((1 << lo) - 1) : 0, high = write ? *v >> lo : 0;
    sk_bits(a, sa, lo, &low, write);
    sk_bits(b, sb, hi, &high, write);
    if (!write) *v = low | high << lo;
}

/* A K-quant block's contents: its quants (the file's unsigned values: Q4_K 0-15, Q5_K 0-31, Q6_K 0-63), its
   scales (Q4_K and Q5_K: 8 of 6 bits; Q6_K: 16 bytes) and minimums, and the bytes of d (then dmin). */
typedef struct {
    int q[256], sc[16], mn[8], half[4];
} sk_kblock;

/* A K-quant block as the file stores it (b) <-> kb. */
static inline void sk_k_file(int type, uint8_t *b, sk_kblock *kb, int write) {
    if (type == SK_Q6_K) {
        for (int s = 0; s < 8; s++)
            for (int j = 0; j < 32; j++) {
                int h = s / 4, i = s % 4;
                sk_bits2(b + 64 * h + 32 * (i & 1) + j, 4 * (i >> 1), 4, b + 128 + 32 * h + j, 2 * i, 2, &kb->q[32 * s + j],
                         write);
            }
        for (int t = 0; t < 16; t++) sk_bits(b + 192 + t, 0, 8, &kb->sc[t], write);
        for (int i = 0; i < 2; i++) sk_bits(b + 208 + i, 0, 8, &kb->half[i], write);
        return;
    }
    uint8_t *q = b + 4, *qs = b + (type == SK_Q4_K ? 16 : 48);
    for (int i = 0; i < 4; i++) sk_bits(b + i, 0, 8, &kb->half[i], write);
    for (int j = 0; j < 4; j++) {  /* sk_k_scale_min's packing */
        sk_bits(q + j, 0, 6, &kb->sc[j], write);
        sk_bits(q + j + 4, 0, 6, &kb->mn[j], write);
        sk_bits2(q + j + 8, 0, 4, q + j, 6, 2, &kb->sc[j + 4], write);
        sk_bits2(q + j + 8, 4, 4, q + j + 4, 6, 2, &kb->mn[j + 4], write);
    }
    for (int s = 0; s < 8; s++)
        for (int j = 0; j < 32; j++) {
            uint8_t *at = qs + 32 * (s / 2) + j;
            if (type == SK_Q5_K)
                sk_bits2(at, 4 * (s & 1), 4, b + 16 + j, s, 1, &kb->q[32 * s + j], write);
            else
                sk_bits(at, 4 * (s & 1), 4, &kb->q[32 * s + j], write);
        }
}

/* Column c's K-quant block in its group's x8 block g <-> kb. */
static inline void sk_k_group(int type, uint8_t *g, int c, sk_kblock *kb, int write) {
    const int six = type == SK_Q6_K, five = type == SK_Q5_K;
    uint8_t *P = g + sk_x8_quants(type), *H = g + sk_x8_high(type);
    for (int s = 0; s < 8; s++)
        for (int i = 0; i < 32; i++) {
            uint8_t *at = P + 128 * s + 32 * (i % 16 / 4) + 4 * c + i % 4;
            int *v = &kb->q[32 * s + i];
            if (six)
                sk_bits2(at, 4 * (i / 16), 4, H + 64 * s + 32 * (i / 16) + 4 * c + i % 4, 2 * (i / 4 % 4), 2, v, write);
            else if (five)
                sk_bits2(at, 4 * (i / 16), 4, H + 32 * s + 4 * c + i % 4, i / 4, 1, v, write);
            else
                sk_bits(at, 4 * (i / 16), 4, v, write);
        }
    for (int i = 0; i < 2; i++) sk_bits(g + 2 * c + i, 0, 8, &kb->half[i], write);
    if (six) {
        for (int t = 0; t < 16; t++) sk_bits(g + SK_Q6X8_C + 8 * t + c, 0, 8, &kb->sc[t], write);
        return;
    }
    for (int i = 0; i < 2; i++) sk_bits(g + 16 + 2 * c + i, 0, 8, &kb->half[2 + i], write);
    for (int s = 0; s < 8; s++) {
        uint8_t *lo = g + SK_KX8_S + 8 * s + c, *hi = g + SK_KX8_U + 4 * c + s / 2;
        sk_bits2(lo, 0, 4, hi, 4 * (s % 2), 2, &kb->sc[s], write);
        sk_bits2(lo, 4, 4, hi, 4 * (s % 2) + 2, 2, &kb->mn[s], write);
    }
}

/* A K-quant column block packed, written out for the load's speed (sk_k_file and sk_k_group take ~20 operations
   a weight; these are sk_k_group's bits, which unpacking and the tests read back): column c's file block b into
   its group's block g. */
static inline void sk_k_pack(int type, const uint8_t *b, uint8_t *g, int c) {
    const int six = type == SK_Q6_K, five = type == SK_Q5_K;
    uint8_t q[256];
    if (six) {
        for (int s = 0; s < 8; s++) {
            const int h = s / 4, i = s % 4;
            const uint8_t *ql = b + 64 * h + 32 * (i & 1), *qh = b + 128 + 32 * h;
            for (int j = 0; j < 32; j++) q[32 * s + j] = (uint8_t)(((ql[j] >> (4 * (i >> 1))) & 15) | ((qh[j] >> (2 * i)) & 3) << 4);
        }
        memcpy(g + 2 * c, b + 208, 2);
        for (int t = 0; t < 16; t++) g[SK_Q6X8_C + 8 * t + c] = b[192 + t];
    } else {
        const uint8_t *qs = b + (five ? 48 : 16);
        for (int s = 0; s < 8; s++)
            for (int j = 0; j < 32; j++)
                q[32 * s + j] = (uint8_t)(((qs[32 * (s / 2) + j] >> (4 * (s & 1))) & 15) | (five ? ((b[16 + j] >> s) & 1) << 4 : 0));
        memcpy(g + 2 * c, b, 2);
        memcpy(g + 16 + 2 * c, b + 2, 2);
        uint32_t u = 0;
        for (int s = 0; s < 8; s++) {
            int sc, mn;
            sk_k_scale_min(b + 4, s, &sc, &mn);
            g[SK_KX8_S + 8 * s + c] = (uint8_t)((sc & 15) | (mn & 15) << 4);
            u |= (uint32_t)((sc >> 4) | (mn >> 4) << 2) << (4 * s);
        }
        memcpy(g + SK_KX8_U + 4 * c, &u, 4);
    }
    uint8_t *P = g + sk_x8_quants(type), *H = g + sk_x8_high(type);
    for (int s = 0; s < 8; s++) {
        const uint8_t *v = q + 32 * s;
        for (int i = 0; i < 16; i++) P[128 * s + 32 * (i / 4) + 4 * c + i % 4] = (uint8_t)((v[i] & 15) | (v[16 + i] & 15) << 4);
        if (five) {
            uint32_t h = 0;
            for (int i = 0; i < 32; i++) h |= (uint32_t)(v[i] >> 4) << (8 * (i % 4) + i / 4);
            memcpy(H + 32 * s + 4 * c, &h, 4);
        }
        if (six)
            for (int i = 0; i < 32; i++) {
                uint8_t *t = H + 64 * s + 32 * (i / 16) + 4 * c + i % 4;
                *t = (uint8_t)((i / 4 % 4 ? *t : 0) | (v[i] >> 4) << (2 * (i / 4 % 4)));
            }
    }
}

/* Moves column c's GGUF block blk into (pack) or out of its place in the group's x8 block grp. */
static inline void sk_x8_move(int type, int c, uint8_t *blk, uint8_t *grp, int pack) {
    if (sk_q_block(type) == 256) {
        sk_kblock kb;
        if (pack) {
            sk_k_pack(type, blk, grp, c);
        } else {
            sk_k_group(type, grp, c, &kb, 0);
            sk_k_file(type, blk, &kb, 1);
        }
        return;
    }
    const int offset = sk_q_offset(type), at_h = sk_x8_high(type), at_q = sk_x8_quants(type), five = at_h != 0;
    const int qs = 2 + 2 * offset + 4 * five, words = type == SK_Q8_0 ? 8 : 4;
#define SK_X8(g, b, n) (pack ? memcpy((g), (b), (n)) : memcpy((b), (g), (n)))
    SK_X8(grp + 2 * c, blk, 2);
    if (offset) SK_X8(grp + 16 + 2 * c, blk + 2, 2);
    for (int q = 0; q < words; q++) SK_X8(grp + at_q + 32 * q + 4 * c, blk + qs + 4 * q, 4);
#undef SK_X8
    if (five) {
        uint8_t *qh = blk + 2 + 2 * offset, *h = grp + at_h + 4 * c;
        uint32_t from = 0, to = 0;
        memcpy(&from, pack ? qh : h, 4);
        for (int i = 0; i < 8; i++)
            for (int t = 0; t < 4; t++) {
                int bit = pack ? (int)(from >> (4 * i + t)) & 1 : (int)(from >> (8 * t + i)) & 1;
                to |= (uint32_t)bit << (pack ? 8 * t + i : 4 * i + t);
            }
        memcpy(pack ? h : qh, &to, 4);
    }
}

/* out = the n rows of w (row_bytes apart, format type) in the x8 layout: (n + 7) / 8 * 8 rows of row_bytes. */
void sk_q_pack(int type, const uint8_t *w, long row_bytes, int n, uint8_t *out, int threads) {
    const int bytes = sk_q_bytes(type), nb = (int)(row_bytes / bytes), groups = (n + 7) / 8;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && groups > 1) schedule(static)
    for (int grp = 0; grp < groups; grp++) {
        uint8_t *g = out + (size_t)grp * 8 * row_bytes;
        if (8 * grp + 8 > n) memset(g, 0, (size_t)8 * row_bytes);  /* the rest is written whole */
        for (int col = 8 * grp; col < n && col < 8 * grp + 8; col++)
            for (int b = 0; b < nb; b++)
                sk_x8_move(type, col % 8, (uint8_t *)w + (size_t)col * row_bytes + (size_t)b * bytes,
                           g + (size_t)b * 8 * bytes, 1);
    }
}

/* out = rows ids [count] of sk_q_pack's layout (packed, format type) back as the file stores them: count rows
   of row_bytes (an embedding's lookup on weights that were packed for the head they share). */
void sk_q_unpack(int type, const uint8_t *packed, long row_bytes, const int64_t *ids, int count, uint8_t *out) {
    const int bytes = sk_q_bytes(type), nb = (int)(row_bytes / bytes);
    for (int r = 0; r < count; r++)
        for (int b = 0; b < nb; b++)
            sk_x8_move(type, (int)(ids[r] % 8), out + (size_t)r * row_bytes + (size_t)b * bytes,
                       (uint8_t *)packed + (size_t)(ids[r] / 8) * 8 * row_bytes + (size_t)b * 8 * bytes, 0);
}

/* The portable definition of a K-quant integer product (sk_qlinear_int_ref's). */
static inline void sk_qlinear_k_ref(int type, const uint8_t *w, long row_bytes, const sk_qrows *xq, uint16_t *y,
                                    int ldy, const float *bias, int m, int k, int c0, int c1, const uint16_t *residual) {
    const int nk = k / 256, nb = k / 32, bytes = sk_q_bytes(type), six = type == SK_Q6_K, zero = sk_q_zero(type);
    sk_kblock *kb = malloc(sizeof(sk_kblock) * (size_t)nk);
    for (int col = c0; col < c1; col++) {
        const uint8_t *group = w + (size_t)(col / 8) * 8 * row_bytes;
        for (int a = 0; a < nk; a++) sk_k_group(type, (uint8_t *)group + (size_t)a * 8 * bytes, col % 8, kb + a, 0);
        for (int r = 0; r < m; r++) {
            const int8_t *q = xq->q + (size_t)r * k;
            const int32_t *xe = xq->xe + (size_t)r * nb, *xs = xq->xs + (size_t)r * nb;
            float l = 0.0f;
            for (int a = 0; a < nk; a++) {
                const sk_kblock *B = kb + a;
                const int8_t *qa = q + 256 * a;
                uint8_t half[4];
                for (int i = 0; i < 4; i++) half[i] = (uint8_t)B->half[i];
                int32_t J = 0, N = 0;
                for (int t = 0; t < (six ? 16 : 8); t++) {
                    const int n = six ? 16 : 32, shift = xe[8 * a + n * t / 32];
                    int32_t I = 0;
                    for (int i = n * t; i < n * t + n; i++) I += (B->q[i] - zero) * qa[i];
                    J += (six ? (int8_t)B->sc[t] : B->sc[t]) * (I * (1 << shift));
                    if (!six) N += B->mn[t] * (xs[8 * a + t] * (1 << shift));
                }
                const float u = xq->d[(size_t)r * nb + 8 * a];
                l = fmaf(sk_f16_to_f32(half) * u, (float)J, l);
                if (!six) l = fmaf(-sk_f16_to_f32(half + 2) * u, (float)N, l);
            }
            const size_t at = (size_t)r * ldy + col;
            y[at] = sk_finish(l, bias, col, residual ? residual + at : NULL);
        }
    }
    free(kb);
}

/* The portable definition of an integer product: column by column, every row (w: sk_q_pack's layout). */
static inline void sk_qlinear_int_ref(int type, const uint8_t *w, long row_bytes, const sk_qrows *xq, uint16_t *y,
                                      int ldy, const float *bias, int m, int k, int c0, int c1,
                                      const uint16_t *residual) {
    if (sk_q_block(type) == 256) {
        sk_qlinear_k_ref(type, w, row_bytes, xq, y, ldy, bias, m, k, c0, c1, residual);
        return;
    }
    const int nb = k / 32, bytes = sk_q_bytes(type), offset = sk_q_offset(type);
    int *wi = malloc(sizeof(int) * (size_t)k);
    float *wd = malloc(sizeof(float) * 2 * (size_t)nb), *wm = wd + nb;
    uint8_t blk[34];
    for (int col = c0; col < c1; col++) {
        const uint8_t *group = w + (size_t)(col / 8) * 8 * row_bytes;
        for (int b = 0; b < nb; b++) {
            sk_x8_move(type, col % 8, blk, (uint8_t *)group + (size_t)b * 8 * bytes, 0);
            sk_q_ints_ref(type, blk, wi + 32 * b, wd + b, wm + b);
        }
        for (int r = 0; r < m; r++) {
            const int8_t *q = xq->q + (size_t)r * k;
            const float *dx = xq->d + (size_t)r * nb, *s = xq->s + (size_t)r * nb;
            float l = 0.0f, o = 0.0f;
            for (int b = 0; b < nb; b++) {
                int part = 0;
                for (int i = 0; i < 32; i++) part += wi[32 * b + i] * q[32 * b + i];
                l = fmaf(wd[b] * dx[b], (float)part, l);
                if (offset) o = fmaf(wm[b], s[b], o);
            }
            const size_t at = (size_t)r * ldy + col;
            y[at] = sk_finish(offset ? l + o : l, bias, col, residual ? residual + at : NULL);
        }
    }
    free(wi);
    free(wd);
}

/* A thread's share of a product's x8 groups, in chunks of `chunk` groups (the last one shorter): the chunks
   front..back-1 of its share not yet taken, packed in one word (front in the low 32 bits) so that the owner,
   taking from the front, and another thread, taking from the back, claim each chunk once with one compare and
   swap. On its own cache line: the owner's claims do not contend with the other shares'. */
typedef struct {
    uint64_t left __attribute__((aligned(64)));
    int first, end;  /* the share's first group and one past its last */
} sk_share;

/* Groups per chunk for `groups` groups among `threads`: about 8 chunks a thread (a chunk is what a thread that
   finished first can still take over), whole 16-column tiles (even), at most 64 groups (one claim each). */
static inline int sk_share_chunk(int groups, int threads) {
    int c = groups / (8 * threads);
    c = c < 2 ? 2 : c > 64 ? 64 : c;
    return c & ~1;
}

static inline void sk_share_init(sk_share *s, int g0, int g1, int chunk) {
    s->first = g0;
    s->end = g1;
    __atomic_store_n(&s->left, (uint64_t)((g1 - g0 + chunk - 1) / chunk) << 32, __ATOMIC_RELAXED);
}

/* Claims the next chunk thread t computes, groups [*g0, *g1): its own share's from the front, then the others'
   from their backs (a column's result does not depend on which thread computes it); 0 when none is left. On a
   shared host one thread can run slower for a while, and with fixed halves the other waited for it at the end of
   every product. */
static inline int sk_share_take(sk_share *share, int t, int nt, int chunk, int *g0, int *g1) {
    for (int i = 0; i < nt; i++) {
        sk_share *s = &share[(t + i) % nt];
        uint64_t old = __atomic_load_n(&s->left, __ATOMIC_RELAXED);
        for (;;) {
            const uint32_t front = (uint32_t)old, back = (uint32_t)(old >> 32);
            if (front >= back) break;
            const uint32_t taken = i == 0 ? front : back - 1;
            const uint64_t next = i == 0 ? old + 1 : (uint64_t)front | (uint64_t)(back - 1) << 32;
            if (__atomic_compare_exchange_n(&s->left, &old, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *g0 = s->first + chunk * (int)taken;
                *g1 = *g0 + chunk < s->end ? *g0 + chunk : s->end;
                return 1;
            }
        }
    }
    return 0;
}

/* The frame every kernel's sk_qlinear shares: the fused op, the inputs quantized, columns shared among threads
   (a column's result does not depend on which thread computes it). */
typedef void (*sk_qicols_fn)(int type, const uint8_t *w, long row_bytes, const sk_qrows *xq, uint16_t *y, int ldy,
                             const float *bias, int m, int k, int c0, int c1, const uint16_t *residual);
typedef void (*sk_quantize_fn)(const uint16_t *x, const sk_qrows *rows, int r);

static inline void sk_qlinear_frame(int type, const uint8_t *w, long row_bytes, const uint16_t *x, uint16_t *y,
                                    int ldy, const float *bias, int m, int k, int n, int threads, int op,
                                    const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *scratch,
                                    float (*sum_squares)(const uint16_t *, int), sk_quantize_fn quantize,
                                    sk_qicols_fn icols) {
    sk_qrows xq = sk_qrows_alloc(m, k, sk_q_act(type));
    sk_share local[8], *share = threads <= 8 ? local : aligned_alloc(64, sizeof(sk_share) * (size_t)threads);
    const int groups = (n + 7) / 8, chunk = sk_share_chunk(groups, threads);
    const int k_in = op == 2 || op == 3 ? 2 * k : k;  /* [gate | up] rows before SwiGLU / GeGLU */
    #pragma omp parallel num_threads(threads) if (threads > 1 && n > 1)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* Rows prepared (the fused op) and quantized in shares too (a row's bytes are the same whoever computes
           them), then columns. */
        const int r0 = (int)((long)m * t / nt), r1 = (int)((long)m * (t + 1) / nt);
        if (r0 < r1) {
            const uint16_t *xp = sk_prepare_rows(x + (size_t)r0 * k_in, r1 - r0, k, op, norm_w, eps,
                                                 op ? scratch + (size_t)r0 * k : NULL, sum_squares);
            for (int r = r0; r < r1; r++) {
                quantize(xp + (size_t)(r - r0) * k, &xq, r);
                sk_qrows_terms(type, &xq, r);
            }
        }
        if (nt == 1) {
            icols(type, w, row_bytes, &xq, y, ldy, bias, m, k, 0, n, residual);
        } else {
            /* Columns in whole x8 groups (what the SIMD kernels take at a time), each thread's share in chunks. */
            sk_share_init(&share[t], (int)((long)groups * t / nt), (int)((long)groups * (t + 1) / nt), chunk);
            #pragma omp barrier
            int g0, g1;
            while (sk_share_take(share, t, nt, chunk, &g0, &g1))
                icols(type, w, row_bytes, &xq, y, ldy, bias, m, k, 8 * g0, 8 * g1 < n ? 8 * g1 : n, residual);
        }
    }
    if (share != local) free(share);
    sk_qrows_free(&xq);
}

#endif

/* The layers in one call, on this library's products and attention (after the #endif: layers.h includes this). */
#include "layers.h"
