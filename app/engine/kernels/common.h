/* What every CPU kernel of specserve shares: the exported interface and the scalar definitions that the
   portable kernels (generic, avx2, avx512) all compute bit for bit.

   The arithmetic, fixed so that a result never depends on how many rows a call has nor on the SIMD width:
   - a dot product of bf16 vectors of length k (k % 32 == 0) keeps 16 float32 lanes; lane i takes, for each
     32-element chunk c, the pair (32c + 2i + 1, 32c + 2i) in that order, each by one fused multiply-add
     (the products of two bf16 values are exact in float32); the lanes are summed as a tree
     (i + i+8, then i + i+4, i + i+2, i + i+1);
   - exp is a degree-6 polynomial on x = n ln2 + r (see sk_exp);
   - softmax sums keys in 16 lanes by key index mod 16, then the same tree; the weighted sum of values runs
     over keys in order, one fused multiply-add per key and dimension;
   - every bf16 result is rounded to nearest even, once. */
#ifndef SPECSERVE_KERNEL_COMMON_H
#define SPECSERVE_KERNEL_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* One sequence of an attention call: its query rows (q_stride apart, heads d apart), its new keys and values
   (k_stride / v_stride apart, kv heads d apart), one layer of its cache ([kv][cap][d]) and its output rows
   ([t][h * d]). `parent`: NULL for a chain (row tt at position start + tt sees keys 0..start + tt); for a
   tree of rows (speculative tree verification), the parent row of each row, -1 for row 0 (the root), every
   parent before its children: row tt at depth D (D ancestors) sits at position start + D and sees keys
   0..start - 1, then its ancestors' and its own, in depth order (attention.h's sk_row_keys). */
typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *kc, *vc, *out;
    int64_t cap, t, start;
    const int32_t *parent;
} part_t;

/* The interface each kernel library exports (ctypes signatures: app/engine/kernels/abi.py).
   sk_linear: y [m, n] = x [m, k] @ w.T (+ bias), w packed as the kernel's Python side lays it out; op 1:
   RMS-normalise each row of x with norm_w and eps first (rounded to bf16); op 2: x is [m, 2k] = [gate | up],
   taken as silu(gate) * up (rounded to bf16) first; op 3: as op 2 with gelu's tanh form for silu (GeGLU);
   residual [m, n] added to the bf16 result where given. scratch: [m, k] bf16 for ops 1-3. */
int sk_init(void);
void sk_linear(const uint16_t *w, const uint16_t *x, uint16_t *y, const float *bias, int m, int k, int n,
               int threads, int op, const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *scratch);
void sk_attention(const part_t *parts, int n_parts, int q_stride, int k_stride, int v_stride, int h, int kv, int d,
                  float scale, int threads);

static inline float sk_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t sk_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The exp every portable kernel computes: x clamped to [-87, 88] (so 2^n is a normal float), n = x / ln2
   rounded to nearest even, r = x - n ln2 in two fused steps, p(r) a degree-6 Taylor polynomial by Horner's
   rule in fused steps, times 2^n. About 1 ulp. */
#define SK_EXP_LO -87.0f
#define SK_EXP_HI 88.0f
#define SK_LOG2E 1.44269504088896341f
#define SK_LN2_HI 0.693359375f
#define SK_LN2_LO -2.12194440e-4f

static inline float sk_exp(float x) {
    /* fminf(fmaxf(x, LO), HI) for every x, NaN included (NaN -> LO), as comparisons: libm's calls are not
       inlined, and they were a visible part of a step's SwiGLU. */
    x = x > SK_EXP_LO ? x : SK_EXP_LO;
    x = x < SK_EXP_HI ? x : SK_EXP_HI;
    float n = nearbyintf(x * SK_LOG2E);
    float r = fmaf(-n, SK_LN2_HI, x);
    r = fmaf(-n, SK_LN2_LO, r);
    float p = 1.0f / 720;
    p = fmaf(p, r, 1.0f / 120);
    p = fmaf(p, r, 1.0f / 24);
    p = fmaf(p, r, 1.0f / 6);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float sk_silu_times(float g, float u) { return g / (1.0f + sk_exp(-g)) * u; }

/* gelu's tanh form times u: 0.5 g (1 + tanh z) = g / (1 + exp(-2 z)), z = sqrt(2 / pi) (g + 0.044715 g^3). */
static inline float sk_gelu_times(float g, float u) {
    float z2 = 1.5957691216057308f * (g + 0.044715f * g * g * g);
    return g / (1.0f + sk_exp(-z2)) * u;
}

/* Row xr [k] RMS-normalised with w and eps into out [k] (bf16, rounded once per element), plus res [k] where
   given (rounded again, as sk_finish adds a residual); `sum_squares`: the kernel's, which gives the canonical
   lanes' bits (sk_sum_squares_ref). out may be xr or res: each element is read before it is written. */
static inline void sk_norm_row(const uint16_t *xr, int k, const uint16_t *w, float eps, const uint16_t *res,
                               uint16_t *out, float (*sum_squares)(const uint16_t *, int)) {
    float scale = 1.0f / sqrtf(sum_squares(xr, k) / k + eps);
    for (int c = 0; c < k; c++) {
        uint16_t y = sk_f32_to_bf16(sk_bf16_to_f32(xr[c]) * scale * sk_bf16_to_f32(w[c]));
        out[c] = res ? sk_f32_to_bf16(sk_bf16_to_f32(y) + sk_bf16_to_f32(res[c])) : y;
    }
}

/* The lane tree: 16 partial sums -> 1. */
static inline float sk_tree16(const float *l) {
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) a[i] = a[i] + a[i + 4];
    for (int i = 0; i < 2; i++) a[i] = a[i] + a[i + 2];
    return a[0] + a[1];
}

/* x [k] bf16 -> its pairs split, float32: odd[16c + i] = x[32c + 2i + 1], even[16c + i] = x[32c + 2i]. */
static inline void sk_split_row(const uint16_t *x, int k, float *odd, float *even) {
    for (int c = 0; c < k / 32; c++)
        for (int i = 0; i < 16; i++) {
            odd[16 * c + i] = sk_bf16_to_f32(x[32 * c + 2 * i + 1]);
            even[16 * c + i] = sk_bf16_to_f32(x[32 * c + 2 * i]);
        }
}

/* The rows a product multiplies, after the fused op: bf16 [m, k] (x itself, or scratch). */
static inline const uint16_t *sk_prepare_rows(const uint16_t *x, int m, int k, int op, const uint16_t *norm_w,
                                              float eps, uint16_t *scratch, float (*sum_squares)(const uint16_t *, int)) {
    if (op == 1) {
        for (int r = 0; r < m; r++) sk_norm_row(x + (size_t)r * k, k, norm_w, eps, NULL, scratch + (size_t)r * k, sum_squares);
        return scratch;
    }
    if (op == 2 || op == 3) {
        for (int r = 0; r < m; r++) {
            const uint16_t *g = x + (size_t)r * 2 * k, *u = g + k;
            for (int c = 0; c < k; c++) {
                float gf = sk_bf16_to_f32(g[c]), uf = sk_bf16_to_f32(u[c]);
                scratch[(size_t)r * k + c] = sk_f32_to_bf16(op == 2 ? sk_silu_times(gf, uf) : sk_gelu_times(gf, uf));
            }
        }
        return scratch;
    }
    return x;
}

/* Sum of squares in the 16 canonical lanes (lane i: elements 16j + i, in order), then the tree. */
static inline float sk_sum_squares_ref(const uint16_t *x, int k) {
    float l[16] = {0};
    for (int j = 0; j < k / 16; j++)
        for (int i = 0; i < 16; i++) {
            float v = sk_bf16_to_f32(x[16 * j + i]);
            l[i] = fmaf(v, v, l[i]);
        }
    return sk_tree16(l);
}

/* Products in the portable kernels: output (r, n) is ONE chain of fused multiply-adds over the inputs in
   order, acc = fma(x[r][kk], w[n][kk], acc) for kk = 0..k-1 from 0 (each product of two bf16 values is
   exact in float32, so the chain is all the rounding there is). Kernels vectorise across columns, never
   across kk, so the chain is the same at any width. Weights are packed in blocks of `width` columns (16 for
   generic and avx2, 32 for avx512): [n/width][k][width/2 pairs][2], pair i of input kk holding columns i
   (low half) and width/2 + i (high half) of the block, so that shifting a 32-bit word left by 16 gives
   column i and masking it gives column width/2 + i, both as float32. */
static inline const uint16_t *sk_block(const uint16_t *w, int k, int width, int blk) {
    return w + (size_t)blk * k * width;
}

/* x [m, k] bf16 -> float32 (exact). */
static inline void sk_widen_rows(const uint16_t *x, size_t count, float *out) {
    for (size_t i = 0; i < count; i++) out[i] = sk_bf16_to_f32(x[i]);
}

/* Rows per pass over the weights: a pass's float32 inputs (rb x k) stay within about 1 MB of cache. */
static inline int sk_row_block(int k) {
    int rb = (1 << 20) / (k * 4);
    return rb < 12 ? 12 : rb / 12 * 12;
}

/* A row's output: the product's bf16, plus the residual in float32, rounded again (as torch's x + f(x)). */
static inline uint16_t sk_finish(float sum, const float *bias, int col, const uint16_t *residual) {
    if (bias) sum += bias[col];
    uint16_t y = sk_f32_to_bf16(sum);
    if (residual) y = sk_f32_to_bf16(sk_bf16_to_f32(y) + sk_bf16_to_f32(*residual));
    return y;
}

/* Sums [R][cols] of a tile whose rows start at r0 and columns at col0 -> y (bias and residual as sk_finish). */
static inline void sk_finish_tile(const float *sums, int R, int cols, int r0, int col0, uint16_t *y,
                                  const float *bias, int n, const uint16_t *residual) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < cols; j++) {
            size_t at = (size_t)(r0 + r) * n + col0 + j;
            y[at] = sk_finish(sums[r * cols + j], bias, col0 + j, residual ? residual + at : NULL);
        }
}

#endif
