/* A decoder's layers in one call (sk_layers): what DecoderBlock.forward runs per layer, product by product, with
   this library's own sk_linear, sk_qlinear and sk_attention and the same arguments, so every value has the bits
   the layer-by-layer path gives; RoPE is torch's three bf16 operations (x * cos, roll(x) * sin, their sum, each
   rounded to bf16). One call instead of about a dozen per layer: on a decoding step of a small model the
   per-call overhead of Python and torch costs as much as the products. */
#ifndef SPECSERVE_KERNEL_LAYERS_H
#define SPECSERVE_KERNEL_LAYERS_H

#include "quant.h"

/* One product: bf16 packed for sk_linear (nseg 0: w, n outputs, no padding) or GGUF segments for sk_qlinear
   (nseg 1-4: consecutive output rows of one format each). */
typedef struct {
    const void *w;
    const float *bias;
    int64_t n, nseg;
    int64_t type[4], rows[4], row_bytes[4];
    const uint8_t *data[4];
} sk_product_t;

/* One layer: its four products (q/k/v fused, output, gate/up fused, down) and its two norms' weights. */
typedef struct {
    sk_product_t qkv, o, gate_up, down;
    const uint16_t *attn_norm, *ffn_norm;
} sk_layer_t;

static inline void sk_product(const sk_product_t *p, const uint16_t *x, uint16_t *y, int m, int k, int threads,
                              int op, const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *scratch) {
    if (p->nseg == 0) {
        sk_linear((const uint16_t *)p->w, x, y, p->bias, m, k, (int)p->n, threads, op, norm_w, eps, residual, scratch);
        return;
    }
    int64_t first = 0;
    for (int s = 0; s < p->nseg; s++) {
        sk_qlinear((int)p->type[s], p->data[s], (long)p->row_bytes[s], x, y + first, (int)p->n,
                   p->bias ? p->bias + first : NULL, m, k, (int)p->rows[s], threads, op, norm_w, eps,
                   residual ? residual + first : NULL, scratch);
        first += p->rows[s];
    }
}

static inline uint16_t sk_bf16_mul(uint16_t a, uint16_t b) { return sk_f32_to_bf16(sk_bf16_to_f32(a) * sk_bf16_to_f32(b)); }

/* x [t][dim] (bf16, in place) through n_layers layers at positions start..start+t-1 of one sequence's cache:
   layer l's keys and values at kc + l * layer_stride, vc + l * layer_stride ([kv][cap][d]); cos, sin: [t][d]
   (sin's first half negated, as rope_tables); inter: the MLP's width. */
void sk_layers(const sk_layer_t *layers, int n_layers, uint16_t *x, int t, int dim, int h, int kv, int d, int inter,
               const uint16_t *cos, const uint16_t *sin, uint16_t *kc, uint16_t *vc, int64_t layer_stride,
               int64_t cap, int64_t start, float eps, float scale, int threads) {
    int width = (h + 2 * kv) * d, rot = (h + kv) * d, big = 2 * inter > width ? 2 * inter : width;
    size_t widest = (size_t)(dim > inter ? dim : inter);
    uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)t * ((size_t)big + rot + h * d + dim + widest));
    uint16_t *wide = buf, *qk = wide + (size_t)t * big, *att = qk + (size_t)t * rot, *mid = att + (size_t)t * h * d,
             *scratch = mid + (size_t)t * dim;
    for (int l = 0; l < n_layers; l++) {
        const sk_layer_t *ly = &layers[l];
        sk_product(&ly->qkv, x, wide, t, dim, threads, 1, ly->attn_norm, eps, NULL, scratch);
        /* RoPE on the query and key heads, out of place (the values stay where the product put them). */
        for (int r = 0; r < t; r++)
            for (int hh = 0; hh < h + kv; hh++) {
                const uint16_t *src = wide + (size_t)r * width + (size_t)hh * d;
                uint16_t *dst = qk + (size_t)r * rot + (size_t)hh * d;
                const uint16_t *c = cos + (size_t)r * d, *s = sin + (size_t)r * d;
                for (int i = 0; i < d; i++) {
                    uint16_t a = sk_bf16_mul(src[i], c[i]), b = sk_bf16_mul(src[(i + d / 2) % d], s[i]);
                    dst[i] = sk_f32_to_bf16(sk_bf16_to_f32(a) + sk_bf16_to_f32(b));
                }
            }
        part_t part;
        memset(&part, 0, sizeof(part));
        part.q = qk;
        part.k = qk + (size_t)h * d;
        part.v = wide + (size_t)rot;
        part.kc = kc + (size_t)l * layer_stride;
        part.vc = vc + (size_t)l * layer_stride;
        part.out = att;
        part.cap = cap;
        part.t = t;
        part.start = start;
        sk_attention(&part, 1, rot, rot, width, h, kv, d, scale, threads);
        sk_product(&ly->o, att, mid, t, h * d, threads, 0, NULL, 0.0f, x, NULL);
        sk_product(&ly->gate_up, mid, wide, t, dim, threads, 1, ly->ffn_norm, eps, NULL, scratch);
        sk_product(&ly->down, wide, x, t, inter, threads, 2, NULL, 0.0f, mid, scratch);
    }
    free(buf);
}

#endif
