/* Products on GGUF quantized weights 16 columns at a time (quant_tile.h at 16 lanes: two adjacent x8 groups in
   each __m512i), for the AVX-512 kernels built with VNNI and BW (avx512vnni, amx); the same bits as the 8-lane
   tiles. q_cols picks the widest driver the build has. */
#ifndef SPECSERVE_KERNEL_QUANT_AVX512_H
#define SPECSERVE_KERNEL_QUANT_AVX512_H

#include "quant_avx2.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QW 16
#include "quant_tile.h"
#undef QW
#define q_cols q_cols_16
#else
#define q_cols q_cols_8
#endif

#endif
