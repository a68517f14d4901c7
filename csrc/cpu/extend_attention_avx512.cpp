// Extend attention (attention.h, extend_attention_impl.h) on AVX-512F: 16 query rows a vector;
// score tiles of 8 keys x 48 rows and value tiles of 8 head dims x 48 rows (24 accumulators; the
// broadcasts fold into the FMAs as embedded broadcasts).
#include <immintrin.h>

#include "attention.h"
#include "extend_attention_impl.h"

namespace pds_cpu {
namespace {

struct Avx512 {
  using reg = __m512;
  static constexpr int W = 16, KB = 8, IB = 8, MB = 3;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg bcast(const float* p) { return _mm512_set1_ps(*p); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  // e^x for x <= 0, as avx2_math.h's exp_clamped_avx2 (x = n ln2 + r, degree-6 polynomial for
  // e^r, times 2^n by scalef); below -87.3, -inf and NaN give 0
  static reg exp_nonpositive(reg x) {
    const reg lo = _mm512_set1_ps(-87.3f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    const reg n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    reg r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    reg y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, n));
  }
};

}  // namespace

void extend_attention_avx512(const ExtendAttention& a, int64_t b, int64_t kvh, int64_t tok0, float* scratch) {
  extend_detail::extend_unit<Avx512>(a, b, kvh, tok0, scratch);
}

}  // namespace pds_cpu
