// AVX2 + FMA path: per block, the 32 weights are widened to bytes in one register and
// multiplied with the int8 activations by maddubs (u8 x s8 -> pairs summed in int16, no
// saturation: 2 * 15 * 127 and 2 * 128 * 127 fit), then madd sums to 8 int32 lanes, which are
// scaled in fp32 (d_w * d_a) and accumulated. MR activation rows share each decoded block.
#include <immintrin.h>

#include <cstdint>

#include "avx2_math.h"
#include "qgemm.h"
#include "dequant_panel.h"
#include "quantize_act.h"

namespace pds_cpu {
namespace {

// 16 bytes of nibbles -> 32 bytes: low nibbles are weights 0..15, high nibbles 16..31.
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

template <int FMT, int MR>
void tile(const QuantAct& a, const uint8_t* wrow, int64_t nb, float* y, int64_t ldy, int64_t m) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  float off[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm256_setzero_ps();
    off[r] = 0.0f;
  }
  const int bpb = block_bytes(FMT);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * bpb;
    const float dw = half_to_float(blk);
    __m256i w;
    float mw = 0.0f;
    if constexpr (FMT == Q4_0) {
      w = unpack_nibbles(blk + 2);
      mw = -8.0f * dw;
    } else if constexpr (FMT == Q4_1) {
      mw = half_to_float(blk + 2);
      w = unpack_nibbles(blk + 4);
    } else {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    }
    const __m256i wabs = FMT == Q8_0 ? _mm256_sign_epi8(w, w) : w;
    for (int r = 0; r < MR; ++r) {
      const int64_t row = (m + r) * (a.K / QK) + b;
      __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + row * QK));
      if constexpr (FMT == Q8_0) av = _mm256_sign_epi8(av, w);  // signs moved onto the activation
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, av), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a.d[row]), acc[r]);
      if constexpr (FMT != Q8_0) off[r] += mw * a.s[row];
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = hsum_avx2(acc[r]) + off[r];
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

// fp32 path: MR activation rows x 16 output features in 2*MR ymm accumulators; each k is two
// panel loads and 2*MR FMAs with a broadcast activation.
template <int MR>
void f32_tile(const float* x, int64_t K, const float* panel, int rows, float* y, int64_t ldy) {
  __m256 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 p0 = _mm256_loadu_ps(panel + k * NR), p1 = _mm256_loadu_ps(panel + k * NR + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
      lo[r] = _mm256_fmadd_ps(xv, p0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, p1, hi[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (rows == NR) {
      _mm256_storeu_ps(y + r * ldy, lo[r]);
      _mm256_storeu_ps(y + r * ldy + 8, hi[r]);
    } else {
      alignas(32) float tmp[NR];
      _mm256_store_ps(tmp, lo[r]);
      _mm256_store_ps(tmp + 8, hi[r]);
      for (int i = 0; i < rows; ++i) y[r * ldy + i] = tmp[i];
    }
  }
}

void gemm_f32(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0, int rows,
              float* panel, float* y, int64_t ldy) {
  dequant_panel(fmt, w, K, n0, rows, panel);
  y += n0;
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) f32_tile<6>(x + m * K, K, panel, rows, y + m * ldy, ldy);
  const float* xm = x + m * K;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 5: f32_tile<5>(xm, K, panel, rows, ym, ldy); break;
    case 4: f32_tile<4>(xm, K, panel, rows, ym, ldy); break;
    case 3: f32_tile<3>(xm, K, panel, rows, ym, ldy); break;
    case 2: f32_tile<2>(xm, K, panel, rows, ym, ldy); break;
    case 1: f32_tile<1>(xm, K, panel, rows, ym, ldy); break;
    default: break;
  }
}

// fp32 dot path (decode, small M): each block's 32 weights dequantized eight at a time in ymm
// registers and multiplied with the fp32 activations of MR rows; no activation rounding.
template <int FMT>
struct Block {  // one weight block's raw bits and scales, loaded once, dequantized by parts
  __m128i lo, hi;  // Q4: low and high nibbles as bytes; Q8_0: the 32 int8 weights
  __m256 d, m;     // scale; Q4_1's minimum, or 8 (Q4_0's offset)

  Block(const float* f16, const uint8_t* blk) : d(_mm256_set1_ps(table_half(f16, blk))) {
    if constexpr (FMT == Q8_0) {
      lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
      hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
      m = _mm256_setzero_ps();
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (FMT == Q4_1 ? 4 : 2)));
      const __m128i mask = _mm_set1_epi8(0x0F);
      lo = _mm_and_si128(raw, mask);
      hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
      m = FMT == Q4_1 ? _mm256_set1_ps(table_half(f16, blk + 2)) : _mm256_set1_ps(8.0f);
    }
  }

  // weights 8 * i .. 8 * i + 7
  __m256 part(int i) const {
    const __m128i bytes = i < 2 ? lo : hi;
    const __m128i q8 = i % 2 ? _mm_srli_si128(bytes, 8) : bytes;
    if constexpr (FMT == Q8_0) return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8));
    return FMT == Q4_1 ? _mm256_fmadd_ps(q, d, m) : _mm256_mul_ps(_mm256_sub_ps(q, m), d);
  }
};

// MR activation rows x NC weight rows, MR * NC independent accumulators (one chain of four
// dependent FMAs a block was latency-bound at one row). Every output element sums its block
// parts in the same order whatever MR and NC: a row's result never depends on the batch.
template <int FMT, int MR, int NC>
void dot_tile(const float* f16, const float* x, int64_t K, const uint8_t* wrow, int64_t row_bytes, float* y,
              int64_t ldy) {
  const int bpb = block_bytes(FMT);
  __m256 acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / QK; ++b) {
    for (int c = 0; c < NC; ++c) {
      const Block<FMT> blk(f16, wrow + c * row_bytes + b * bpb);
      for (int i = 0; i < 4; ++i) {
        const __m256 w = blk.part(i);
        for (int r = 0; r < MR; ++r)
          acc[r][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * K + b * QK + 8 * i), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) y[r * ldy + c] = hsum_avx2(acc[r][c]);
}

// The same driver as qgemm_avx512.cpp's, on purpose: each file is built with its own ISA flags, and a
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
  int64_t m = 0;  // 16 ymm registers: at most 8 accumulators
  for (; m + 4 <= M; m += 4) dot_cols<FMT, 4, 2>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1);
  switch (M - m) {
    case 3: dot_cols<FMT, 3, 2>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1); break;
    case 2: dot_cols<FMT, 2, 1>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1); break;  // one weight row
    case 1: dot_cols<FMT, 1, 1>(f16, x, K, w, row_bytes, y, ldy, m, n0, n1); break;  // (qgemm_avx512.cpp)
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

// the dot path up to any M (the caller hands 64 rows and more to torch's GEMM): AVX2's
// panel tile measured slower (docs/quantization.md)
const Kernels kAvx2 = {quantize_row_impl, gemm, gemm_f32, gemm_dot, dequant_rows, INT64_MAX};

}  // namespace pds_cpu
