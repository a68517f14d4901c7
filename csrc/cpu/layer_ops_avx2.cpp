// Rotary embedding and SwiGLU for the fused layer blocks (layer_ops.h), AVX2 + FMA.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "layer_ops.h"

namespace pds_cpu {
namespace {

// e^x, 8 lanes, by the algorithm and constants of SLEEF's expf (its 1.0-ulp variant), which torch's
// vectorized exp calls: so SwiGLU here is torch's F.silu bit for bit (with this unit built without
// contracting products into sums), and a prompt gives the same activations fused or op by op.
// x = q ln2 + s (ln2 in two parts), e^s by a degree-6 polynomial in FMAs, times 2^q in two steps
// (q may reach 150, past one exponent's range); 0 below -104, infinity above 100.
inline __m256 exp_sleef_avx2(__m256 x) {
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(1.442695040888963407359924681001892137f)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), x);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
  __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
  u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  // u * 2^q as u * 2^(q >> 1) * 2^(q - (q >> 1)): each factor's exponent stays in range
  const __m256i half = _mm256_srai_epi32(q, 1);
  const auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  u = _mm256_mul_ps(_mm256_mul_ps(u, pow2(half)), pow2(_mm256_sub_epi32(q, half)));
  u = _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
  return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.0f), x, _CMP_LT_OQ));
}

}  // namespace

void rotary_halves_avx2(float* x, int64_t heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = x + h * head_dim;
    float* x2 = x1 + half;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
      const __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
      const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
      _mm256_storeu_ps(x1 + i, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
      _mm256_storeu_ps(x2 + i, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
    }
    for (; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

void silu_mul_avx2(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_sleef_avx2(_mm256_xor_ps(g, sign));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void floats_to_half_avx2(const float* src, uint16_t* dst, int64_t n) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kNearest));
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], kNearest);
}

}  // namespace pds_cpu
