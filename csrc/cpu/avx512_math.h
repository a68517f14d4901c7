// A small AVX-512F helper shared (as source) by the AVX-512 attention units. Include only from
// units compiled with -mavx512f.
#pragma once
#include <immintrin.h>

namespace pds_cpu {

// e^x for x <= 0, 16 lanes, as avx2_math.h's exp_clamped_avx2 (x = n ln2 + r, a degree-6
// polynomial for e^r, times 2^n by scalef); below -87.3, -inf and NaN give 0, which is what a
// softmax needs for masked keys.
static inline __m512 exp_nonpositive_avx512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, n));
}

}  // namespace pds_cpu
