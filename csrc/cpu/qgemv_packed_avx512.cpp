// The packed int16-activation product (qgemv_packed.h), AVX-512 F/BW/VNNI.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "qgemv_packed.h"

namespace pds_cpu {

namespace {

// One block's scale (amax / 32767) and the reciprocal the values are multiplied by.
inline float block_scale(__m512 v0, __m512 v1, __m512* inv) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
  const float d = amax / 32767.0f;
  *inv = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  return d;
}

}  // namespace

void packed_prepare_avx512(const float* x, int64_t M, int64_t K, int16_t* a, float* da, float* xs) {
  for (int64_t i = 0; i < M * (K / 32); ++i) {  // block i of the M rows (rows are whole blocks)
    const float* xb = x + i * 32;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    __m512 inv;
    const float d = block_scale(v0, v1, &inv);
    // cvtps rounds to nearest even (the default MXCSR mode); |x / d| <= 32767 fits int16
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + i * 32), _mm512_cvtepi32_epi16(i0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + i * 32 + 16), _mm512_cvtepi32_epi16(i1));
    da[i] = d;
    xs[i] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
  }
}

namespace {

// Two int16 activations broadcast as one 32-bit value to every lane (memcpy: no aliasing of the
// int16 array as int32; it compiles to one broadcast load).
inline __m512i pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// MR activation rows x one panel (16 weight rows), all blocks. Each block's products go to int32
// chains (two per row, four for one or two rows, so a lone row is not bound by vpdpwssd's
// latency), summed exactly at the block's end and scaled into one fp32 accumulator per row.
template <int MR>
void panel_tile(const uint8_t* qs, const float* dm, int64_t nb, const int16_t* a, const float* da,
                const float* xs, float* y, int64_t ldy, __mmask16 cols) {
  constexpr int CH = MR <= 2 ? 2 : 1;
  const int64_t astride = nb * 32;  // int16 values a row
  const __m512i low = _mm512_set1_epi16(0x0F);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i lo[CH][MR], hi[CH][MR];
    for (int h = 0; h < CH; ++h)
      for (int r = 0; r < MR; ++r) lo[h][r] = hi[h][r] = _mm512_setzero_si512();
    const uint8_t* qb = qs + b * 256;
    for (int c0 = 0; c0 < 8; c0 += CH) {  // chain h takes chunks c0 + h (constant indices: registers)
      for (int h = 0; h < CH; ++h) {
        const int c = c0 + h;
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * 32)));
        const __m512i w0 = _mm512_and_si512(bytes, low);  // weights 4c, 4c+1 of each row
        const __m512i w1 = _mm512_srli_epi16(bytes, 4);   // weights 4c+2, 4c+3
        for (int r = 0; r < MR; ++r) {
          const int16_t* ar = a + r * astride + b * 32 + 4 * c;
          lo[h][r] = _mm512_dpwssd_epi32(lo[h][r], w0, pair(ar));
          hi[h][r] = _mm512_dpwssd_epi32(hi[h][r], w1, pair(ar + 2));
        }
      }
    }
    const __m512 d = _mm512_loadu_ps(dm + b * 32), m = _mm512_loadu_ps(dm + b * 32 + 16);
    for (int r = 0; r < MR; ++r) {
      __m512i s = _mm512_add_epi32(lo[0][r], hi[0][r]);
      for (int h = 1; h < CH; ++h) s = _mm512_add_epi32(s, _mm512_add_epi32(lo[h][r], hi[h][r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(da[r * nb + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, cols, acc[r]);
}

// The same for a Q8_0 panel: per block 16 chunks of 32 int8 weights, each sign-extended into one
// vpdpwssd operand (a pair of weights of one row per lane), and one scale d per row (no offsets,
// so `xs` is not read). Two int32 chains a row, four for one or two rows.
template <int MR>
void q8_panel_tile(const uint8_t* qs, const float* dq, int64_t nb, const int16_t* a, const float* da,
                   float* y, int64_t ldy, __mmask16 cols) {
  constexpr int CH = MR <= 2 ? 4 : 2;
  const int64_t astride = nb * 32;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s[CH][MR];
    for (int h = 0; h < CH; ++h)
      for (int r = 0; r < MR; ++r) s[h][r] = _mm512_setzero_si512();
    const uint8_t* qb = qs + b * 512;
    for (int c0 = 0; c0 < 16; c0 += CH) {  // chain h takes chunks c0 + h (constant indices: s stays in registers)
      for (int h = 0; h < CH; ++h) {
        const int c = c0 + h;
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * 32)));
        for (int r = 0; r < MR; ++r) s[h][r] = _mm512_dpwssd_epi32(s[h][r], w, pair(a + r * astride + b * 32 + 2 * c));
      }
    }
    const __m512 d = _mm512_loadu_ps(dq + b * 16);
    for (int r = 0; r < MR; ++r) {
      __m512i t = s[0][r];
      for (int h = 1; h < CH; ++h) t = _mm512_add_epi32(t, s[h][r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(da[r * nb + b])), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, cols, acc[r]);
}

constexpr int kTileRows = 4;

// Rows [m0, m1) of one panel, in tiles of kTileRows and a tail.
template <bool Q8>
void panel_rows(const Packed& w, int64_t p, const int16_t* a, const float* da, const float* xs, int64_t m0,
                int64_t m1, float* y, int64_t ldy, __mmask16 cols) {
  const int64_t nb = w.nb, stride = nb * 32;
  const uint8_t* qs = w.qs + p * nb * (Q8 ? 512 : 256);
  const float* dm = w.dm + p * nb * (Q8 ? 16 : 32);
  auto tile = [&](auto rows, int64_t r) {
    constexpr int R = decltype(rows)::value;
    if constexpr (Q8)
      q8_panel_tile<R>(qs, dm, nb, a + r * stride, da + r * nb, y + r * ldy, ldy, cols);
    else
      panel_tile<R>(qs, dm, nb, a + r * stride, da + r * nb, xs + r * nb, y + r * ldy, ldy, cols);
  };
  int64_t r = m0;
  for (; r + kTileRows <= m1; r += kTileRows) tile(std::integral_constant<int, kTileRows>{}, r);
  switch (m1 - r) {
    case 3: tile(std::integral_constant<int, 3>{}, r); break;
    case 2: tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

}  // namespace

void packed_gemm_avx512(const Packed& w, const int16_t* a, const float* da, const float* xs, int64_t m0,
                        int64_t m1, int64_t N, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n = p * kPanelRows;
    const __mmask16 cols = static_cast<__mmask16>(N - n >= kPanelRows ? 0xFFFF : (1u << (N - n)) - 1);
    if (w.q8)
      panel_rows<true>(w, p, a, da, xs, m0, m1, y + n, ldy, cols);
    else
      panel_rows<false>(w, p, a, da, xs, m0, m1, y + n, ldy, cols);
  }
}

}  // namespace pds_cpu
