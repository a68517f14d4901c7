// The packed int16-activation GEMV (qgemv_packed.h), AVX-512 F/BW.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

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

void packed_prepare_avx512(const float* x, int64_t M, int64_t K, int64_t nbp, int16_t* a, float* da,
                           float* xs) {
  const int64_t nb = K / 32;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nbp; ++b) {
      int16_t* out = a + (r * nbp + b) * 32;
      if (b >= nb) {  // the padding block of an odd count: zero weights, zero activations
        _mm512_storeu_si512(out, _mm512_setzero_si512());
        da[r * nbp + b] = xs[r * nbp + b] = 0.0f;
        continue;
      }
      const float* xb = x + r * K + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      __m512 inv;
      const float d = block_scale(v0, v1, &inv);
      // cvtps rounds to nearest even (the default MXCSR mode); |x / d| <= 32767 fits int16
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
      const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(i0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm512_cvtepi32_epi16(i1));
      da[r * nbp + b] = d;
      xs[r * nbp + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
    }
  }
}

void round_int16_avx512(const float* x, int64_t M, int64_t K, float* out) {
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    const float* xb = x + i * 32;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    __m512 inv;
    const __m512 d = _mm512_set1_ps(block_scale(v0, v1, &inv));
    _mm512_storeu_ps(out + i * 32, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))), d));
    _mm512_storeu_ps(out + i * 32 + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))), d));
  }
}

namespace {

// MR activation rows x one weight row; two accumulators per row (even and odd blocks), so the
// FMA chain of a single row is not latency-bound.
template <int MR>
void tile(const PackedQ4& w, const int16_t* a, const float* da, const float* xs, float* y, int64_t ldy,
          int64_t n) {
  const int64_t nbp = w.nbp;
  const uint8_t* qs = w.qs + n * nbp * 16;
  const float* d = w.dm + n * 2 * nbp;
  const float* m = d + nbp;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m512 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < nbp / 2; ++p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + p * 32));
    const __m512i w0 = _mm512_cvtepu8_epi16(_mm256_and_si256(v, low));
    const __m512i w1 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    const float d0 = d[2 * p], d1 = d[2 * p + 1];
    for (int r = 0; r < MR; ++r) {
      const int16_t* ar = a + (r * nbp + 2 * p) * 32;
      const __m512i s0 = _mm512_madd_epi16(w0, _mm512_loadu_si512(ar));
      const __m512i s1 = _mm512_madd_epi16(w1, _mm512_loadu_si512(ar + 32));
      const float* dr = da + r * nbp + 2 * p;
      acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(d0 * dr[0]), acc0[r]);
      acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(d1 * dr[1]), acc1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {  // + sum_b m_b * (sum of the block's activations)
    const float* xr = xs + r * nbp;
    __m512 off = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 16 <= nbp; b += 16) off = _mm512_fmadd_ps(_mm512_loadu_ps(m + b), _mm512_loadu_ps(xr + b), off);
    if (b < nbp) {
      const __mmask16 k = static_cast<__mmask16>((1u << (nbp - b)) - 1);
      off = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + b), _mm512_maskz_loadu_ps(k, xr + b), off);
    }
    y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0[r], acc1[r]), off));
  }
}

}  // namespace

void packed_gemv_avx512(const PackedQ4& w, const int16_t* a, const float* da, const float* xs, int64_t M,
                        float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t stride = w.nbp * 32;
  for (int64_t n = n0; n < n1; ++n) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4)
      tile<4>(w, a + r * stride, da + r * w.nbp, xs + r * w.nbp, y + r * ldy + n, ldy, n);
    const int16_t* ar = a + r * stride;
    const float* dr = da + r * w.nbp;
    const float* xr = xs + r * w.nbp;
    float* yr = y + r * ldy + n;
    switch (M - r) {
      case 3: tile<3>(w, ar, dr, xr, yr, ldy, n); break;
      case 2: tile<2>(w, ar, dr, xr, yr, ldy, n); break;
      case 1: tile<1>(w, ar, dr, xr, yr, ldy, n); break;
      default: break;
    }
  }
}

}  // namespace pds_cpu
