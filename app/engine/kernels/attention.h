/* Attention's scheduling, which every kernel but amx shares: a call's sequences (part_t) cut into work items (a kv
   head and a run of rows), the items shared among the threads (or, when too few, each item's steps shared), and
   each row's keys found (a chain's prefix, a tree row's ancestors). A kernel brings only its steps
   (sk_attention_kernel) and calls sk_attention_heads; the arithmetic the steps compute is common.h's. Which thread
   or item computes a row never changes its bits. */
#ifndef SPECSERVE_KERNEL_ATTENTION_H
#define SPECSERVE_KERNEL_ATTENTION_H

#include "common.h"

/* Copy a part's new keys and values into its cache at start..start+t-1. */
static inline void sk_write_cache(const part_t *pt, int k_stride, int v_stride, int kv, int d) {
    for (int tt = 0; tt < pt->t; tt++)
        for (int g = 0; g < kv; g++) {
            size_t slot = ((size_t)g * pt->cap + pt->start + tt) * d;
            memcpy(pt->kc + slot, pt->k + (size_t)tt * k_stride + (size_t)g * d, (size_t)d * 2);
            memcpy(pt->vc + slot, pt->v + (size_t)tt * v_stride + (size_t)g * d, (size_t)d * 2);
        }
}

/* The cache slot of key j (see sk_attention_kernel). */
static inline size_t sk_slot(int j, int n0, const int32_t *tail) { return j < n0 ? (size_t)j : (size_t)tail[j - n0]; }

/* A row's keys: its position qpos and where its keys lie past the contiguous prefix (n0, tail; see
   sk_attention_kernel). For a tree part, `path` (room for t ints) receives the slots of the row's ancestors
   and its own, root first. */
static inline void sk_row_keys(const part_t *pt, int tt, int32_t *path, int *qpos, int *n0, const int32_t **tail) {
    int start = (int)pt->start;
    if (!pt->parent) {
        *qpos = start + tt;
        *n0 = *qpos + 1;
        *tail = NULL;
        return;
    }
    int depth = 0;
    for (int r = tt; pt->parent[r] >= 0; r = pt->parent[r]) depth++;
    for (int i = depth, r = tt; i >= 0; i--, r = pt->parent[r]) path[i] = start + r;
    int lead = 0;  /* ancestors already in their sequential slots (the first chain of the tree) read as a prefix */
    while (lead <= depth && path[lead] == start + lead) lead++;
    *qpos = start + depth;
    *n0 = start + lead;
    *tail = path + lead;
}

/* The work items of an attention call: each part's new keys and values written into its cache; returned (to
   free), first[p] part p's first item, first[n_parts] their count. An item is a kv head and a run of up to
   *block consecutive rows of one chain part (a tree part's rows one at a time: their keys differ), so that the
   rows' weighted sums of values read each value once; *block is 4, halved while that leaves fewer than four
   items a thread. *longest the longest sequence (at least 16), *rows the most rows of a tree part (at least 1). */
static inline long *sk_attention_items(const part_t *parts, int n_parts, int k_stride, int v_stride, int kv, int d,
                                       int threads, int *block, int64_t *longest, int64_t *rows) {
    long *first = malloc(sizeof(long) * (n_parts + 1));
    *longest = 16;
    *rows = 1;
    for (int p = 0; p < n_parts; p++) {
        sk_write_cache(&parts[p], k_stride, v_stride, kv, d);
        if (parts[p].start + parts[p].t > *longest) *longest = parts[p].start + parts[p].t;
        if (parts[p].parent && parts[p].t > *rows) *rows = parts[p].t;
    }
    for (*block = 4;; *block /= 2) {
        long total = 0;
        for (int p = 0; p < n_parts; p++) {
            first[p] = total;
            total += (parts[p].parent ? parts[p].t : (parts[p].t + *block - 1) / *block) * kv;
        }
        first[n_parts] = total;
        if (*block == 1 || total >= 4L * threads) break;
    }
    return first;
}

/* What a kernel gives attention: the steps of H rows that read the same keys of one kv head's cache (kc, vc:
   [cap][d]), row i at position n[i] - 1 reading keys 0..n[i]-1, its scores in s[i] (room for n[i] + 16 floats).
   Key j lies in slot j for j < n0 and in slot tail[j - n0] after (a tree row's ancestors, sk_slot); a chain's
   rows have n0 >= n[i]. The arithmetic runs over key indices j, never slots, and each row's alone: a tree row gets
   the very bits the same row gets in sequential decoding, whose keys are those values in slots 0..n[i]-1, and a
   row the bits it gets beside any others, and whichever range of keys or dimensions a step is given.
   - keys: the scaled scores of keys j0..min(j1, n[i])-1 (j0 a multiple of 16) into s[i][j], each key's the tree of
     its own lanes; qs[i] is row i's query split (sk_split_row: odd half, then even half);
   - peak: the largest of s[0..n-1];
   - exps: s[j] = exp(s[j] - mx) for j0 <= j < j1, in place;
   - sum: 1 / the sum of s[0..n-1], in 16 lanes by key index mod 16, keys in order, then the tree;
   - values: the weighted sums of values of H <= side rows (inverses inv), row i over keys 0..n[i]-1, dimensions
     d0..d1-1 (multiples of 32), into out[0..H-1] (each dimension's chain over its row's keys in order). */
typedef struct {
    void (*keys)(int H, const float *const *qs, const int *n, const uint16_t *kc, int d, float scale, float *const *s,
                 int n0, const int32_t *tail, int j0, int j1);
    float (*peak)(const float *s, int n);
    void (*exps)(float *s, int j0, int j1, float mx);
    float (*sum)(const float *s, int n);
    void (*values)(int H, float *const *s, const int *n, const uint16_t *vc, int d, const float *inv,
                   uint16_t *const *out, int n0, const int32_t *tail, int d0, int d1);
    int side;
} sk_attention_kernel;

/* An attention call's shape and its work items (sk_attention_items). */
typedef struct {
    const part_t *parts;
    const long *first;
    int q_stride, h, kv, d, block;
} sk_attention_call;

/* One thread's room for an item: its rows' score rows (span floats each, where span > 0), split queries,
   pointers to both, inverses, outputs, queries, key counts and a tree row's path; two allocations. */
typedef struct {
    float *sbuf, *split, **s, *inv;
    const float **qs;
    uint16_t **out;
    const uint16_t **q;
    int *n;
    int32_t *path;
} sk_item_room;

static inline void sk_room_alloc(sk_item_room *r, size_t span, int most, int d, int64_t rows) {
    const size_t m = (size_t)most;
    r->sbuf = aligned_alloc(64, sizeof(float) * (span + (size_t)d) * m);
    r->split = r->sbuf + span * m;
    void **p = malloc(sizeof(void *) * 4 * m + sizeof(float) * m + sizeof(int) * m + sizeof(int32_t) * (size_t)rows);
    r->s = (float **)p;
    r->qs = (const float **)(p + m);
    r->out = (uint16_t **)(p + 2 * m);
    r->q = (const uint16_t **)(p + 3 * m);
    r->inv = (float *)(p + 4 * m);
    r->n = (int *)(r->inv + m);
    r->path = (int32_t *)(r->n + m);
}

static inline void sk_room_free(sk_item_room *r) {
    free(r->s);
    free(r->sbuf);
}

/* Item `it`'s rows into room (score rows span apart from sbuf): returns H (rows x heads, a run's rows in order,
   each row's heads in order); *kc, *vc its kv head's caches, *n0 and *tail its keys past the prefix. A run's
   last row reads every key the others read (a chain: n0 = its position + 1). */
static inline int sk_item_rows(const sk_attention_call *c, long it, sk_item_room *room, float *sbuf, size_t span,
                               const uint16_t **kc, const uint16_t **vc, int *n0, const int32_t **tail) {
    const int group = c->h / c->kv, d = c->d;
    int p = 0;
    while (c->first[p + 1] <= it) p++;
    const part_t *pt = &c->parts[p];
    const long local = it - c->first[p];
    /* Head-major: a kv head's runs of rows one after another, so that its keys and values (a few hundred KB at
       long contexts) stay in a core's L2 from run to run, instead of every run reading every head's anew. */
    const int step = pt->parent ? 1 : c->block, runs = ((int)pt->t + step - 1) / step;
    const int t0 = (int)(local % runs) * step, g = (int)(local / runs);
    const int nr = pt->t - t0 < step ? (int)pt->t - t0 : step;
    *kc = pt->kc + (size_t)g * pt->cap * d;
    *vc = pt->vc + (size_t)g * pt->cap * d;
    int qpos = 0;
    for (int i = 0; i < nr; i++) {
        const int tt = t0 + i;
        sk_row_keys(pt, tt, room->path, &qpos, n0, tail);
        for (int r = 0; r < group; r++) {
            const int hh = g * group + r, at = i * group + r;
            room->s[at] = sbuf + span * at;
            room->q[at] = pt->q + (size_t)tt * c->q_stride + (size_t)hh * d;
            room->out[at] = pt->out + (size_t)tt * c->h * d + (size_t)hh * d;
            room->n[at] = qpos + 1;
        }
    }
    return nr * group;
}

/* The queries of an item's rows split (room->qs). */
static inline void sk_item_split(sk_item_room *room, int H, int d) {
    for (int i = 0; i < H; i++) {
        room->qs[i] = room->split + (size_t)i * d;
        sk_split_row(room->q[i], d, room->split + (size_t)i * d, room->split + (size_t)i * d + d / 2);
    }
}

/* An item's weighted sums of values over dimensions d0..d1-1, `side` rows at a time. */
static inline void sk_item_values(const sk_attention_kernel *K, sk_item_room *room, int H, const uint16_t *vc, int d,
                                  int n0, const int32_t *tail, int d0, int d1) {
    for (int r0 = 0; r0 < H; r0 += K->side)
        K->values(H - r0 < K->side ? H - r0 : K->side, room->s + r0, room->n + r0, vc, d, room->inv + r0,
                  room->out + r0, n0, tail, d0, d1);
}

/* Scores' multiply-adds (keys x heads x dimensions) of the item slots the threads' last round would leave idle,
   from which the items' steps are shared (sk_attention_shared): below, the two barriers cost more. */
#define SK_SHARED_IDLE (1L << 17)

/* Too few items for the threads (a decoding step's 3 kv heads on 2 threads leave one thread idle a third of the
   time; Gemma 3's one kv head, half): each item's steps split among the threads in ranges that leave every
   result's bits as they are. The scores of a range of keys, and their peak, each; after a barrier, the
   exponentials of a range of keys each (a row's peak the largest of its ranges': max is exact); after another,
   the weighted sums of values of a range of dimensions each (every thread takes a row's sum over all its keys
   itself, in key order). */
static inline void sk_attention_shared(const sk_attention_call *c, long total, const sk_attention_kernel *K,
                                       float scale, int threads, size_t span, int most, int64_t longest,
                                       int64_t rows) {
    const int d = c->d;
    const int chunk = (int)((longest + threads - 1) / threads + 15) / 16 * 16;
    /* Ranges of dimensions in whole pairs of 64-byte lines of each value (threads reading halves of the same pair
       would each fetch both: the prefetchers pull lines in pairs). */
    const int pairs = (d + 63) / 64, dparts = pairs < threads ? pairs : threads;
    const int dims = (pairs + dparts - 1) / dparts * 64;
    float *sbuf = aligned_alloc(64, sizeof(float) * span * (size_t)most * (size_t)total);
    float *tops = malloc(sizeof(float) * (size_t)most * (size_t)total * (size_t)threads);  /* [item][row][range] */
    #pragma omp parallel num_threads(threads)
    {
        sk_item_room room;
        sk_room_alloc(&room, 0, most, d, rows);
        const uint16_t *kc = NULL, *vc = NULL;
        int n0 = 0;
        const int32_t *tail = NULL;
        #pragma omp for schedule(static)
        for (long u = 0; u < total * threads; u++) {
            const long it = u / threads;
            const int H = sk_item_rows(c, it, &room, sbuf + span * most * it, span, &kc, &vc, &n0, &tail);
            const int j0 = (int)(u % threads) * chunk;
            float *top = tops + (size_t)most * threads * it + u % threads;
            if (j0 < room.n[H - 1]) {
                sk_item_split(&room, H, d);
                K->keys(H, room.qs, room.n, kc, d, scale, room.s, n0, tail, j0, j0 + chunk);
            }
            for (int i = 0; i < H; i++) {
                const int j1 = j0 + chunk < room.n[i] ? j0 + chunk : room.n[i];
                top[(size_t)threads * i] = j0 < j1 ? K->peak(room.s[i] + j0, j1 - j0) : -INFINITY;
            }
        }
        #pragma omp for schedule(static)
        for (long u = 0; u < total * threads; u++) {
            const long it = u / threads;
            const int H = sk_item_rows(c, it, &room, sbuf + span * most * it, span, &kc, &vc, &n0, &tail);
            const int j0 = (int)(u % threads) * chunk;
            for (int i = 0; i < H; i++) {
                if (j0 >= room.n[i]) continue;
                const float *top = tops + (size_t)most * threads * it + (size_t)threads * i;
                float mx = top[0];
                for (int r = 1; r < threads; r++) mx = fmaxf(mx, top[r]);
                K->exps(room.s[i], j0, j0 + chunk < room.n[i] ? j0 + chunk : room.n[i], mx);
            }
        }
        #pragma omp for schedule(static)
        for (long u = 0; u < total * dparts; u++) {
            const long it = u / dparts;
            const int H = sk_item_rows(c, it, &room, sbuf + span * most * it, span, &kc, &vc, &n0, &tail);
            const int d0 = (int)(u % dparts) * dims;
            if (d0 >= d) continue;
            for (int i = 0; i < H; i++) room.inv[i] = K->sum(room.s[i], room.n[i]);
            sk_item_values(K, &room, H, vc, d, n0, tail, d0, d0 + dims < d ? d0 + dims : d);
        }
        sk_room_free(&room);
    }
    free(tops);
    free(sbuf);
}

/* Causal attention for several sequences in one call: each part's new keys and values are written into its
   cache, then its query row (t, head hh) attends keys 0..start+t of kv head hh / (h / kv) (a tree part's row: its
   prefix and ancestors, see part_t), by the kernel's steps K. Work items (a kv head and a run of rows,
   sk_attention_items) are shared among the threads: the heads that share a kv head, and the run's rows, read
   the same keys, so their scores share each key's load and their weighted sums of values run side by side,
   K->side at a time. Too few items for the threads at long contexts share each item (sk_attention_shared). A
   row's result does not depend on which thread or item. */
static inline void sk_attention_heads(const part_t *parts, int n_parts, int q_stride, int k_stride, int v_stride, int h,
                                      int kv, int d, float scale, int threads, const sk_attention_kernel *K) {
    sk_attention_call c = {parts, NULL, q_stride, h, kv, d, 0};
    int64_t longest, rows;
    long *first = sk_attention_items(parts, n_parts, k_stride, v_stride, kv, d, threads, &c.block, &longest, &rows);
    c.first = first;
    const long total = first[n_parts];
    const size_t span = (size_t)(longest + 16 + 15) / 16 * 16;
    const int most = h / kv * c.block;  /* rows x heads of an item */
    const long idle = (total + threads - 1) / threads * threads - total;
    if (threads > 1 && total < 2 * threads && idle * longest * (h / kv) * d >= SK_SHARED_IDLE) {
        sk_attention_shared(&c, total, K, scale, threads, span, most, longest, rows);
        free(first);
        return;
    }
    #pragma omp parallel num_threads(threads) if (threads > 1 && total > 1)
    {
        sk_item_room room;
        sk_room_alloc(&room, span, most, d, rows);
        const uint16_t *kc = NULL, *vc = NULL;
        int n0 = 0;
        const int32_t *tail = NULL;
        #pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < total; it++) {
            const int H = sk_item_rows(&c, it, &room, room.sbuf, span, &kc, &vc, &n0, &tail);
            sk_item_split(&room, H, d);
            K->keys(H, room.qs, room.n, kc, d, scale, room.s, n0, tail, 0, room.n[H - 1]);
            for (int i = 0; i < H; i++) {
                K->exps(room.s[i], 0, room.n[i], K->peak(room.s[i], room.n[i]));
                room.inv[i] = K->sum(room.s[i], room.n[i]);
            }
            sk_item_values(K, &room, H, vc, d, n0, tail, 0, d);
        }
        sk_room_free(&room);
    }
    free(first);
}

#endif
