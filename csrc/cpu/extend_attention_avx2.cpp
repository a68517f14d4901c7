// Extend attention (attention.h, extend_attention_impl.h) on AVX2 + FMA: 8 query rows a vector;
// score tiles of 4 keys x 24 rows and value tiles of 4 head dims x 24 rows (12 accumulators,
// 3 row vectors and one broadcast: the 16 ymm registers).
#include <immintrin.h>

#include "attention.h"
#include "avx2_math.h"
#include "extend_attention_impl.h"

namespace pds_cpu {
namespace {

struct Avx2 {
  using reg = __m256;
  static constexpr int W = 8, KB = 4, IB = 4, MB = 3;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  // e^x for x <= 0; below -87.3, -inf and NaN (max returns its second operand for NaN) give 0
  static reg exp_nonpositive(reg x) {
    const reg lo = _mm256_set1_ps(-87.3f);
    const reg keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    return _mm256_and_ps(exp_clamped_avx2(_mm256_max_ps(x, lo)), keep);
  }
  static void widen(const uint16_t* h, float* f, int64_t n) {
    for (int64_t i = 0; i < n; i += W)
      _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
};

}  // namespace

void extend_attention_avx2(const ExtendAttention& a, int64_t b, int64_t kvh, int64_t tok0, float* scratch) {
  extend_detail::extend_unit<Avx2>(a, b, kvh, tok0, scratch);
}

}  // namespace pds_cpu
