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

/* One layer: its four products (q/k/v fused, output, gate/up fused, down) and its two norms' weights; what a block
   beyond Llama's adds (NULL or 0: none): RMS norms over each head of q and of k before RoPE (Qwen3, Gemma 3),
   norms on the attention's and the MLP's outputs before their residual adds (Gemma), GeGLU (gelu's tanh form)
   for SwiGLU, a sliding window (the last `window` positions), and RoPE from the local tables. */
typedef struct {
    sk_product_t qkv, o, gate_up, down;
    const uint16_t *attn_norm, *ffn_norm;
    const uint16_t *q_norm, *k_norm, *post_attn_norm, *post_ffn_norm;
    int64_t gelu, window, local;
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

/* One head's RoPE (d even): dst[i] = x[i] * c[i] + x[i +- d/2] * s[i], each product and the sum rounded to bf16
   as torch's three operations round them. In halves, without an index modulo d, so that gcc vectorises it. */
static inline void sk_rope_row(const uint16_t *x, const uint16_t *c, const uint16_t *s, int d, uint16_t *dst) {
    const int half = d / 2;
    for (int side = 0; side < 2; side++) {
        const int lo = side * half, other = side ? -half : half;
        for (int i = lo; i < lo + half; i++) {
            uint16_t a = sk_bf16_mul(x[i], c[i]), b = sk_bf16_mul(x[i + other], s[i]);
            dst[i] = sk_f32_to_bf16(sk_bf16_to_f32(a) + sk_bf16_to_f32(b));
        }
    }
}

/* y [m][k] = each row of x [m][k] RMS-normalised with w and eps (bf16, as a product's op 1), plus residual
   [m][k] where given (rounded again, as sk_finish adds one). y may be x or residual: an element is read before
   it is written. k % 16 == 0. The norms a block runs outside its products (q/k, post-attention, post-MLP). */
void sk_rms_norm(const uint16_t *x, uint16_t *y, const uint16_t *w, int m, int k, float eps, const uint16_t *residual) {
    for (int r = 0; r < m; r++)
        sk_norm_row(x + (size_t)r * k, k, w, eps, residual ? residual + (size_t)r * k : NULL, y + (size_t)r * k,
                    sk_sum_squares_ref);
}

/* A chain part of t rows at start, of a layer with a sliding window: as the decoder's _window_parts, a row at
   position p >= window attends positions p - window + 1..p as a part of its own over the cache seen from
   p - window + 1 (the same strides; keys in their order, so each row's bits are its own). Returns the count. */
static int sk_window_parts(const part_t *base, int64_t window, int q_stride, int k_stride, int v_stride,
                           int out_stride, int d, part_t *out) {
    if (!window || base->start + base->t <= window) {
        out[0] = *base;
        return 1;
    }
    int n = 0;
    int64_t first = window - base->start > 0 ? window - base->start : 0;
    if (first) {
        out[n] = *base;
        out[n++].t = first;
    }
    for (int64_t r = first; r < base->t; r++) {
        int64_t shift = base->start + r - window + 1;
        part_t p = *base;
        p.q += r * q_stride;
        p.k += r * k_stride;
        p.v += r * v_stride;
        p.out += r * out_stride;
        p.kc += shift * d;
        p.vc += shift * d;
        p.t = 1;
        p.start = window - 1;
        out[n++] = p;
    }
    return n;
}

/* One sequence of a batch through the layers (sk_layers): t rows at positions start..start+t-1 of its
   cache, layer l's keys and values at kc + l * layer_stride, vc + l * layer_stride ([kv][cap][d]); parent: NULL
   for a chain, else its rows' tree (part_t's). */
typedef struct {
    uint16_t *kc, *vc;
    int64_t layer_stride, cap, t, start;
    const int32_t *parent;
} sk_seq_t;

/* x [T][dim] (bf16, in place; T the sequences' rows, one after another) through n_layers layers, each sequence
   attending its own cache (seqs, n_seqs); cos, sin: [T][d], each row's position's (sin's first half negated, as
   rope_tables), cos_local, sin_local the same for layers with `local` (NULL without); inter: the MLP's width.
   Every step is the layer-by-layer path's call on this library (products over all T rows, sk_rms_norm, one
   sk_attention with a part per sequence) with its arguments, so every value has its bits. */
void sk_layers(const sk_layer_t *layers, int n_layers, uint16_t *x, const sk_seq_t *seqs, int n_seqs, int dim,
                     int h, int kv, int d, int inter, const uint16_t *cos, const uint16_t *sin,
                     const uint16_t *cos_local, const uint16_t *sin_local, float eps, float scale, int threads) {
    int width = (h + 2 * kv) * d, rot = (h + kv) * d, big = 2 * inter > width ? 2 * inter : width, t = 0;
    for (int i = 0; i < n_seqs; i++) t += (int)seqs[i].t;
    size_t widest = (size_t)(dim > inter ? dim : inter);
    uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)t * ((size_t)big + rot + h * d + 2 * dim + widest));
    uint16_t *wide = buf, *qk = wide + (size_t)t * big, *att = qk + (size_t)t * rot, *mid = att + (size_t)t * h * d,
             *out = mid + (size_t)t * dim, *scratch = out + (size_t)t * dim;
    part_t *parts = malloc(sizeof(part_t) * (size_t)(t + n_seqs));
    for (int l = 0; l < n_layers; l++) {
        const sk_layer_t *ly = &layers[l];
        sk_product(&ly->qkv, x, wide, t, dim, threads, 1, ly->attn_norm, eps, NULL, scratch);
        if (ly->q_norm)  /* each head of q, then of k, in place: rows of d */
            for (int r = 0; r < t; r++) {
                uint16_t *row = wide + (size_t)r * width;
                sk_rms_norm(row, row, ly->q_norm, h, d, eps, NULL);
                sk_rms_norm(row + (size_t)h * d, row + (size_t)h * d, ly->k_norm, kv, d, eps, NULL);
            }
        const uint16_t *lc = ly->local ? cos_local : cos, *ls = ly->local ? sin_local : sin;
        /* RoPE on the query and key heads, out of place (the values stay where the product put them). */
        for (int r = 0; r < t; r++)
            for (int hh = 0; hh < h + kv; hh++) {
                const uint16_t *src = wide + (size_t)r * width + (size_t)hh * d;
                uint16_t *dst = qk + (size_t)r * rot + (size_t)hh * d;
                sk_rope_row(src, lc + (size_t)r * d, ls + (size_t)r * d, d, dst);
            }
        int n_parts = 0;
        for (int i = 0, row = 0; i < n_seqs; row += (int)seqs[i].t, i++) {
            part_t part;
            memset(&part, 0, sizeof(part));
            part.q = qk + (size_t)row * rot;
            part.k = part.q + (size_t)h * d;
            part.v = wide + (size_t)row * width + (size_t)rot;
            part.kc = seqs[i].kc + (size_t)l * seqs[i].layer_stride;
            part.vc = seqs[i].vc + (size_t)l * seqs[i].layer_stride;
            part.out = att + (size_t)row * h * d;
            part.cap = seqs[i].cap;
            part.t = seqs[i].t;
            part.start = seqs[i].start;
            part.parent = seqs[i].parent;
            n_parts += sk_window_parts(&part, ly->window, rot, rot, width, h * d, d, parts + n_parts);
        }
        sk_attention(parts, n_parts, rot, rot, width, h, kv, d, scale, threads);
        /* h = x + o (or + its norm) into mid; then the MLP, x = h + down (or + its norm). */
        if (ly->post_attn_norm) {
            sk_product(&ly->o, att, out, t, h * d, threads, 0, NULL, 0.0f, NULL, NULL);
            sk_rms_norm(out, mid, ly->post_attn_norm, t, dim, eps, x);
        } else {
            sk_product(&ly->o, att, mid, t, h * d, threads, 0, NULL, 0.0f, x, NULL);
        }
        sk_product(&ly->gate_up, mid, wide, t, dim, threads, 1, ly->ffn_norm, eps, NULL, scratch);
        int act = ly->gelu ? 3 : 2;
        if (ly->post_ffn_norm) {
            sk_product(&ly->down, wide, out, t, inter, threads, act, NULL, 0.0f, NULL, scratch);
            sk_rms_norm(out, x, ly->post_ffn_norm, t, dim, eps, mid);
        } else {
            sk_product(&ly->down, wide, x, t, inter, threads, act, NULL, 0.0f, mid, scratch);
        }
    }
    free(parts);
    free(buf);
}

/* A feature draft (app/engine/drafting/eagle.py): its fusion product over [embedding | state] rows, its one layer,
   its final norm, its head over the draft vocabulary, and the draft vocabulary's embedding rows [vocab][dim]. */
typedef struct {
    sk_product_t fc, head;
    sk_layer_t layer;
    const uint16_t *norm, *embed;
    int64_t dim, heads, kv_heads, head_dim, inter, vocab;
    float eps, scale;
} sk_draft_t;

/* A feature draft's greedy chain in one call: what the Python path runs token after token (the fusion product,
   sk_layers with the one layer, the final norm, the head, the greedy choice, the chosen token's row fed back with
   the guessed state), each with this library's calls and their arguments, so every value has that path's bits. A
   draft token otherwise runs about a dozen Python and torch operations around its four kernel calls, each of them
   cold after the draft's weights went through the caches: together they cost more than the arithmetic.
   The first forward reads t rows at cache positions start..start+t-1: states [t][dim] and embeds (t pointers to
   embedding rows [dim]). Up to k tokens (draft vocabulary indices) go into tokens; the chain stops before a token
   whose probability (softmax of the head's logits, summed in index order) is below p_min, or where the product of
   the chain's probabilities (in float, token after token) falls below v_min. cos, sin: RoPE tables from
   position 0, [positions][d]. Writes the last guessed state [dim] into guess and the position after the last
   forward into *next; returns the tokens' count. */
int sk_draft_chain(const sk_draft_t *dr, const uint16_t *states, const uint16_t **embeds, int t, uint16_t *kc,
                   uint16_t *vc, int64_t cap, int64_t start, const uint16_t *cos, const uint16_t *sin, int k,
                   float p_min, float v_min, int threads, int32_t *tokens, uint16_t *guess, int64_t *next) {
    const int dim = (int)dr->dim, d = (int)dr->head_dim, vocab = (int)dr->vocab, rows = t > 1 ? t : 1;
    uint16_t *in = malloc(sizeof(uint16_t) * ((size_t)rows * 3 * dim + dim + vocab));
    uint16_t *x = in + (size_t)rows * 2 * dim, *g = x + (size_t)rows * dim, *logits = g + dim;
    for (int r = 0; r < t; r++) {
        memcpy(in + (size_t)r * 2 * dim, embeds[r], sizeof(uint16_t) * dim);
        memcpy(in + (size_t)r * 2 * dim + dim, states + (size_t)r * dim, sizeof(uint16_t) * dim);
    }
    int n = 0, m = t;
    int64_t pos = start;
    float value = 1.0f;
    while (m > 0) {
        sk_product(&dr->fc, in, x, m, 2 * dim, threads, 0, NULL, 0.0f, NULL, NULL);
        sk_seq_t seq = {kc, vc, 0, cap, m, pos, NULL};
        const uint16_t *c = cos + (size_t)pos * d, *s = sin + (size_t)pos * d;
        sk_layers(&dr->layer, 1, x, &seq, 1, dim, (int)dr->heads, (int)dr->kv_heads, d, (int)dr->inter, c, s, c, s,
                  dr->eps, dr->scale, threads);
        sk_rms_norm(x + (size_t)(m - 1) * dim, g, dr->norm, 1, dim, dr->eps, NULL);
        pos += m;
        sk_product(&dr->head, g, logits, 1, dim, threads, 0, NULL, 0.0f, NULL, NULL);
        int best = 0;
        float top = sk_bf16_to_f32(logits[0]);
        for (int i = 1; i < vocab; i++) {
            float v = sk_bf16_to_f32(logits[i]);
            if (v > top) top = v, best = i;
        }
        if (p_min > 0.0f || v_min > 0.0f) {
            float sum = 0.0f;
            for (int i = 0; i < vocab; i++) sum += expf(sk_bf16_to_f32(logits[i]) - top);
            value *= 1.0f / sum;
            if (1.0f / sum < p_min || value < v_min) break;
        }
        tokens[n++] = best;
        if (n >= k) break;
        memcpy(in, dr->embed + (size_t)best * dim, sizeof(uint16_t) * dim);
        memcpy(in + dim, g, sizeof(uint16_t) * dim);
        m = 1;
    }
    memcpy(guess, g, sizeof(uint16_t) * dim);
    *next = pos;
    free(in);
    return n;
}

#endif
