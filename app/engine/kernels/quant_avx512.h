/* Products on GGUF quantized weights 16 columns at a time (quant_tile.h at 16 lanes: two adjacent x8 groups in
   each __m512i), for the AVX-512 kernels built with VNNI and BW (avx512vnni, amxint8, amx); the same bits as the
   8-lane tiles; many rows on AMX-INT8 tiles where the build has them (quant_amx.h: amxint8, amx; the amx-twin
   stand-in). q_cols picks the widest driver the build has. */
#ifndef SPECSERVE_KERNEL_QUANT_AVX512_H
#define SPECSERVE_KERNEL_QUANT_AVX512_H

#include "quant_avx2.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QW 16
#include "quant_tile.h"
#undef QW
#if defined(__AMX_INT8__) || defined(SK_AMX_TWIN)
#include "quant_amx.h"
#define q_cols q_cols_amx
#else
#define q_cols q_cols_16
#endif
#else
#define q_cols q_cols_8
#endif

#endif
