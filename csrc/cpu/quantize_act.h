// Activation quantization shared (as source) by the AVX2 and AVX-512 units, so both paths
// quantize bit-identically: d = amax / 127, q = round_half_even(x * (1 / d)).
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "qgemm.h"

namespace pds_cpu {

static inline void quantize_row_impl(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
    __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    // cvtps rounds to nearest even (the default MXCSR mode), as torch.round does
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    i0 = _mm256_permutevar8x32_epi32(i0, perm);  // packs interleave 128-bit lanes; undo it
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), i0);
    d[b] = dd;
    s[b] = dd * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

}  // namespace pds_cpu
