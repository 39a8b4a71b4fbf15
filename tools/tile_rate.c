/* One kernel library's integer products per format and row count, on one thread, in multiply-adds per second:
   sk_qlinear (activations quantized, tiles, bf16 results) on N columns x K inputs of random blocks (default 2048 x
   1024: a megabyte or two, in the core's and the shared cache, so that the rate is the arithmetic's, not the
   memory's; each row's quantization, a few per cent of a product here, included). Best of 7 runs of many calls each.
   tools/measure_tiles.py builds and runs it beside tools/roofline.c.

   Usage: tile_rate LIBRARY.so [N K]   (a kernel's library: app/engine/kernels, as kernels.load builds it) */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*pack_fn)(int type, const uint8_t *w, long row_bytes, int n, uint8_t *out, int threads);
typedef void (*qlinear_fn)(int type, const uint8_t *w, long row_bytes, const uint16_t *x, uint16_t *y, int ldy,
                           const float *bias, int m, int k, int n, int threads, int op, const uint16_t *norm_w,
                           float eps, const uint16_t *residual, uint16_t *scratch);

/* GGML's type ids, inputs and bytes per block; where the block's float16 scales lie (d, then m or dmin: -1 none). */
static const struct {
    const char *name;
    int type, block, bytes, d, m;
} FORMATS[] = {
    {"Q4_0", 2, 32, 18, 0, -1},     {"Q4_1", 3, 32, 20, 0, 2},      {"Q5_0", 6, 32, 22, 0, -1},
    {"Q5_1", 7, 32, 24, 0, 2},      {"Q8_0", 8, 32, 34, 0, -1},     {"Q4_K", 12, 256, 144, 0, 2},
    {"Q5_K", 13, 256, 176, 0, 2},   {"Q6_K", 14, 256, 210, 208, -1},
};
static const int ROWS[] = {1, 2, 4, 8, 16, 64};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 4) {
        fprintf(stderr, "usage: %s LIBRARY.so [N K]\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    pack_fn pack = (pack_fn)dlsym(lib, "sk_q_pack");
    qlinear_fn qlinear = (qlinear_fn)dlsym(lib, "sk_qlinear");
    if (!pack || !qlinear) {
        fprintf(stderr, "%s has no integer products\n", argv[1]);
        return 1;
    }
    const int n = argc == 4 ? atoi(argv[2]) : 2048, k = argc == 4 ? atoi(argv[3]) : 1024, most = 64;
    if (n <= 0 || n % 8 || k <= 0 || k % 32) {
        fprintf(stderr, "N: a multiple of 8, K: of 32 (the K-quants, taken where K is one of 256)\n");
        return 2;
    }
    srand(1);
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)most * k), *y = malloc(sizeof(uint16_t) * (size_t)most * n);
    for (int i = 0; i < most * k; i++) x[i] = bf16((float)(rand() % 4001 - 2000) / 1000.0f);
    for (size_t f = 0; f < sizeof FORMATS / sizeof FORMATS[0]; f++) {
        if (k % FORMATS[f].block) continue;
        const long rb = (long)k / FORMATS[f].block * FORMATS[f].bytes;
        uint8_t *w = malloc((size_t)n * rb), *packed = malloc((size_t)n * rb);
        for (size_t i = 0; i < (size_t)n * rb; i++) w[i] = (uint8_t)rand();
        for (long b = 0; b < n * rb / FORMATS[f].bytes; b++) {  /* scales of a sensible size: 2^-10 (float16) */
            uint8_t *p = w + b * FORMATS[f].bytes;
            p[FORMATS[f].d] = 0x00, p[FORMATS[f].d + 1] = 0x14;
            if (FORMATS[f].m >= 0) p[FORMATS[f].m] = 0x00, p[FORMATS[f].m + 1] = 0x14;
        }
        pack(FORMATS[f].type, w, rb, n, packed, 1);
        for (size_t ri = 0; ri < sizeof ROWS / sizeof ROWS[0]; ri++) {
            /* About 4e8 multiply-adds a run (at most 2,000 calls: small products are mostly call). */
            const int m = ROWS[ri];
            const double many = 4e8 / ((double)m * n * k);
            const int calls = many > 2000 ? 2000 : (int)many + 3;
            double best = 1e30;
            for (int run = 0; run < 7; run++) {
                double t = now();
                for (int c = 0; c < calls; c++)
                    qlinear(FORMATS[f].type, packed, rb, x, y, n, NULL, m, k, n, 1, 0, NULL, 0.0f, NULL, NULL);
                t = (now() - t) / calls;
                if (t < best) best = t;
            }
            printf("%s %d %.3f %.1f\n", FORMATS[f].name, m, best * 1e6, (double)m * n * k / best / 1e9);
        }
        free(w);
        free(packed);
    }
    free(x);
    free(y);
    return 0;
}
