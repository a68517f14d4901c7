// AVX-512 VNNI path: two blocks per 512-bit register. vpdpbusd multiplies u8 weights by s8
// activations and sums groups of four into int32 lanes in one instruction (lanes 0-7 block b,
// 8-15 block b+1), which are scaled in fp32 by a vector holding each block's d_w * d_a.
// Q8_0 weights are signed: their absolute value goes in the u8 operand and their sign onto the
// activation (|w| <= 128, |a| <= 127, so the product never overflows).
#include <immintrin.h>

#include "qgemm.h"
#include "dequant_panel.h"
#include "quantize_act.h"

namespace pds_cpu {
namespace {

inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

template <int FMT>
inline __m256i block_weights(const uint8_t* blk) {
  if constexpr (FMT == Q4_0) return unpack_nibbles(blk + 2);
  if constexpr (FMT == Q4_1) return unpack_nibbles(blk + 4);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
}

template <int FMT>
inline float block_offset(const uint8_t* blk, float dw) {  // what multiplies d_a * sum(q_a)
  if constexpr (FMT == Q4_0) return -8.0f * dw;
  if constexpr (FMT == Q4_1) return half_to_float(blk + 2);
  return 0.0f;
}

template <int FMT, int MR>
void tile(const QuantAct& a, const uint8_t* wrow, int64_t nb, float* y, int64_t ldy, int64_t m) {
  const int bpb = block_bytes(FMT);
  __m512 acc[MR];
  float off[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm512_setzero_ps();
    off[r] = 0.0f;
  }
  for (int64_t b = 0; b < nb; b += 2) {
    const bool pair = b + 1 < nb;
    const uint8_t* b0 = wrow + b * bpb;
    const uint8_t* b1 = b0 + bpb;
    const float d0 = half_to_float(b0), d1 = pair ? half_to_float(b1) : 0.0f;
    const float o0 = block_offset<FMT>(b0, d0), o1 = pair ? block_offset<FMT>(b1, d1) : 0.0f;
    const __m256i w1 = pair ? block_weights<FMT>(b1) : _mm256_setzero_si256();
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(block_weights<FMT>(b0)), w1, 1);
    __mmask64 neg = 0;
    if constexpr (FMT == Q8_0) {
      neg = _mm512_movepi8_mask(w);
      w = _mm512_abs_epi8(w);
    }
    const __mmask64 lanes = pair ? ~__mmask64(0) : __mmask64(0xFFFFFFFFu);
    for (int r = 0; r < MR; ++r) {
      const int64_t row = (m + r) * (a.K / QK) + b;
      __m512i av = _mm512_maskz_loadu_epi8(lanes, a.q + row * QK);
      if constexpr (FMT == Q8_0) av = _mm512_mask_sub_epi8(av, neg, _mm512_setzero_si512(), av);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, av);
      const float da1 = pair ? a.d[row + 1] : 0.0f;
      const __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0 * a.d[row]),
                                                _mm512_set1_ps(d1 * da1));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[r]);
      if constexpr (FMT != Q8_0) off[r] += o0 * a.s[row] + (pair ? o1 * a.s[row + 1] : 0.0f);
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = _mm512_reduce_add_ps(acc[r]) + off[r];
}

template <int FMT>
void gemm_fmt(const QuantAct& a, const uint8_t* w, float* y, int64_t ldy, int64_t m0, int64_t m1,
              int64_t n0, int64_t n1) {
  const int64_t nb = a.K / QK, row_bytes = nb * block_bytes(FMT);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = w + n * row_bytes;
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) tile<FMT, 4>(a, wrow, nb, y + m * ldy + n, ldy, m);
    switch (m1 - m) {
      case 3: tile<FMT, 3>(a, wrow, nb, y + m * ldy + n, ldy, m); break;
      case 2: tile<FMT, 2>(a, wrow, nb, y + m * ldy + n, ldy, m); break;
      case 1: tile<FMT, 1>(a, wrow, nb, y + m * ldy + n, ldy, m); break;
      default: break;
    }
  }
}

void gemm(int fmt, const QuantAct& a, const uint8_t* w, float* y, int64_t ldy, int64_t m0,
          int64_t m1, int64_t n0, int64_t n1) {
  switch (fmt) {
    case Q4_0: gemm_fmt<Q4_0>(a, w, y, ldy, m0, m1, n0, n1); break;
    case Q4_1: gemm_fmt<Q4_1>(a, w, y, ldy, m0, m1, n0, n1); break;
    default: gemm_fmt<Q8_0>(a, w, y, ldy, m0, m1, n0, n1); break;
  }
}

// fp32 path: MR activation rows x 16 output features in MR zmm accumulators; each k is one
// panel load and MR FMAs with a broadcast activation.
template <int MR>
void f32_tile(const float* x, int64_t K, const float* panel, int rows, float* y, int64_t ldy) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 p = _mm512_loadu_ps(panel + k * NR);
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), p, acc[r]);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << rows) - 1);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, valid, acc[r]);
}

void gemm_f32(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int rows,
              float* panel, float* y, int64_t ldy) {
  dequant_panel(fmt, w, K, n0, rows, panel);
  y += n0;
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) f32_tile<8>(x + m * K, K, panel, rows, y + m * ldy, ldy);
  const float* xm = x + m * K;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 7: f32_tile<7>(xm, K, panel, rows, ym, ldy); break;
    case 6: f32_tile<6>(xm, K, panel, rows, ym, ldy); break;
    case 5: f32_tile<5>(xm, K, panel, rows, ym, ldy); break;
    case 4: f32_tile<4>(xm, K, panel, rows, ym, ldy); break;
    case 3: f32_tile<3>(xm, K, panel, rows, ym, ldy); break;
    case 2: f32_tile<2>(xm, K, panel, rows, ym, ldy); break;
    case 1: f32_tile<1>(xm, K, panel, rows, ym, ldy); break;
    default: break;
  }
}

// fp32 dot path (decode, small M): each block's 32 weights dequantized in two zmm registers
// (w = d*q + m as one FMA) and multiplied with the fp32 activations of MR rows; no activation
// rounding, so the result is the reference's up to fp32 summation order. Scales come from the
// fp16 table (broadcast from memory); Q4 nibbles are widened once (16 bytes to 16 dwords) and
// split by mask and shift: one shuffle a block instead of two, plus none for the scales.
template <int FMT>
inline void dequant_block(const float* f16, const uint8_t* blk, __m512& w0, __m512& w1) {
  const __m512 d = _mm512_set1_ps(table_half(f16, blk));
  if constexpr (FMT == Q8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
  } else {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (FMT == Q4_1 ? 4 : 2))));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    if constexpr (FMT == Q4_1) {
      const __m512 m = _mm512_set1_ps(table_half(f16, blk + 2));
      w0 = _mm512_fmadd_ps(lo, d, m);
      w1 = _mm512_fmadd_ps(hi, d, m);
    } else {  // (q - 8) * d: q - 8 is exact, so this rounds once, like the reference
      w0 = _mm512_mul_ps(_mm512_sub_ps(lo, _mm512_set1_ps(8.0f)), d);
      w1 = _mm512_mul_ps(_mm512_sub_ps(hi, _mm512_set1_ps(8.0f)), d);
    }
  }
}

// MR activation rows x NC weight rows: each block of the NC weight rows is dequantized once and
// used for every activation row; the MR * NC accumulators are independent chains, enough to keep
// the FMA units busy at one row (one chain of two dependent FMAs a block was latency-bound). Every
// output element still sums its blocks in the same order (two FMAs a block, then the same
// reduction) whatever MR and NC, so a row's result never depends on how many rows share the call.
template <int FMT, int MR, int NC>
void dot_tile(const float* f16, const float* x, int64_t K, const uint8_t* wrow, int64_t row_bytes, float* y,
              int64_t ldy) {
  const int bpb = block_bytes(FMT);
  __m512 acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / QK; ++b) {
    __m512 w0[NC], w1[NC];
    for (int c = 0; c < NC; ++c) dequant_block<FMT>(f16, wrow + c * row_bytes + b * bpb, w0[c], w1[c]);
    for (int r = 0; r < MR; ++r) {
      const __m512 x0 = _mm512_loadu_ps(x + r * K + b * QK), x1 = _mm512_loadu_ps(x + r * K + b * QK + 16);
      for (int c = 0; c < NC; ++c) {
        acc[r][c] = _mm512_fmadd_ps(w0[c], x0, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(w1[c], x1, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) y[r * ldy + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// Rows m in [m0, M) in tiles of MR (a tail of fewer), weight rows [n0, n1) NC at a time.
// The same driver as qgemm_avx2.cpp's, on purpose: each file is built with its own ISA flags, and a
// shared inline template would be one symbol compiled two ways (the linker keeps either).
template <int FMT, int MR, int NC>
void dot_cols(const float* f16, const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, float* y,
              int64_t ldy, int64_t m, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NC <= n1; n += NC)
    dot_tile<FMT, MR, NC>(f16, x + m * K, K, w + n * row_bytes, row_bytes, y + m * ldy + n, ldy);
  for (; n < n1; ++n)
    dot_tile<FMT, MR, 1>(f16, x + m * K, K, w + n * row_bytes, row_bytes, y + m * ldy + n, ldy);
}

template <int FMT>
void dot_fmt(const float* x, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t ldy, int64_t n0,
             int64_t n1) {
  const int64_t row_bytes = K / QK * block_bytes(FMT);
  const float* f16 = f16_table();
  // 8 rows x 2 weight rows: 16 accumulators + 4 weight registers of the 32. Up to 4 rows read one
  // weight row at a time: several weight rows in flight (4 interleaved streams 20-34 bytes a
  // step) measured 1.5-2.6x slower on a Zen 4 when the matrix streams from memory (the LM head,
  // a whole decode step), whatever they gained on hot caches.
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) dot_cols<FMT, 8, 2>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1);
  switch (M - m) {
    case 7: dot_cols<FMT, 7, 2>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1); break;
    case 6: dot_cols<FMT, 6, 2>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1); break;
    case 5: dot_cols<FMT, 5, 2>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1); break;
    case 4: dot_cols<FMT, 4, 1>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1); break;
    case 3: dot_cols<FMT, 3, 1>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1); break;
    case 2: dot_cols<FMT, 2, 1>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1); break;
    case 1: dot_cols<FMT, 1, 1>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1); break;
    default: break;
  }
}

void gemm_dot(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w, float* y, int64_t ldy,
              int64_t n0, int64_t n1) {
  switch (fmt) {
    case Q4_0: dot_fmt<Q4_0>(x, M, K, w, y, ldy, n0, n1); break;
    case Q4_1: dot_fmt<Q4_1>(x, M, K, w, y, ldy, n0, n1); break;
    default: dot_fmt<Q8_0>(x, M, K, w, y, ldy, n0, n1); break;
  }
}

}  // namespace

// fp32 panels only from 64 rows: the dot path's 8 x 2 tiles re-dequantize a block once per 8 rows
// in registers, which beat the scalar panel dequantization up to 32 rows (Q8_0 LM head, 2 threads:
// 7.7 against 15.7 ms at 16 rows, 13.7 against 19.9 at 32) and was level at 64. Below that, a row
// also gets the same bits alone and among others (the dot path's sums do not depend on M).
const Kernels kAvx512 = {quantize_row_impl, gemm, gemm_f32, gemm_dot, dequant_rows, 64};

}  // namespace pds_cpu
