// Weight panels for the fp32 path (prefill and large batches): NR = 16 weight rows dequantized
// once into a K x 16 fp32 panel (transposed, so one vector load gives 16 output features), which
// the micro-kernel then multiplies by every activation row with fp32 FMAs. Shared as source by
// the AVX2 and AVX-512 units; scalar code, its cost is spread over all M rows.
#pragma once
#include <cstdint>

#include "qgemm.h"
#include "quantize_act.h"

namespace pds_cpu {

// panel[k * NR + i] = W[n0 + i][k] for i < rows, 0 for the missing rows of a last panel.
static inline void dequant_panel(int fmt, const uint8_t* w, int64_t K, int64_t n0, int rows,
                                 float* panel) {
  const int bpb = block_bytes(fmt);
  const int64_t nb = K / QK, row_bytes = nb * bpb;
  for (int i = 0; i < NR; ++i) {
    if (i >= rows) {
      for (int64_t k = 0; k < K; ++k) panel[k * NR + i] = 0.0f;
      continue;
    }
    const uint8_t* row = w + (n0 + i) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * bpb;
      const float d = half_to_float(blk);
      float* out = panel + b * QK * NR + i;
      if (fmt == Q8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int j = 0; j < QK; ++j) out[j * NR] = d * static_cast<float>(q[j]);
      } else {
        const uint8_t* qs = blk + (fmt == Q4_1 ? 4 : 2);
        // w = d*q + m (Q4_1) or d*(q - 8) (Q4_0), computed as the torch reference does
        const float m = fmt == Q4_1 ? half_to_float(blk + 2) : 0.0f;
        for (int j = 0; j < QK / 2; ++j) {
          const float lo = static_cast<float>(qs[j] & 0x0F), hi = static_cast<float>(qs[j] >> 4);
          if (fmt == Q4_1) {
            out[j * NR] = lo * d + m;
            out[(j + QK / 2) * NR] = hi * d + m;
          } else {
            out[j * NR] = (lo - 8.0f) * d;
            out[(j + QK / 2) * NR] = (hi - 8.0f) * d;
          }
        }
      }
    }
  }
}

// out[(n - n0) * K + k] = W[n][k] for n in [n0, n1): plain rows, for a GEMM library.
static inline void dequant_rows(int fmt, const uint8_t* w, int64_t K, int64_t n0, int64_t n1,
                                float* out) {
  const int bpb = block_bytes(fmt);
  const int64_t nb = K / QK, row_bytes = nb * bpb;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + n * row_bytes + b * bpb;
      const float d = half_to_float(blk);
      float* o = out + (n - n0) * K + b * QK;
      if (fmt == Q8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int j = 0; j < QK; ++j) o[j] = d * static_cast<float>(q[j]);
      } else if (fmt == Q4_1) {
        const float m = half_to_float(blk + 2);
        const uint8_t* qs = blk + 4;
        for (int j = 0; j < QK / 2; ++j) {
          o[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
          o[j + QK / 2] = static_cast<float>(qs[j] >> 4) * d + m;
        }
      } else {
        const uint8_t* qs = blk + 2;
        for (int j = 0; j < QK / 2; ++j) {
          o[j] = (static_cast<float>(qs[j] & 0x0F) - 8.0f) * d;
          o[j + QK / 2] = (static_cast<float>(qs[j] >> 4) - 8.0f) * d;
        }
      }
    }
  }
}

}  // namespace pds_cpu
