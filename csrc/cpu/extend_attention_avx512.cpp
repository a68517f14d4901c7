// Extend attention (attention.h, extend_attention_impl.h) on AVX-512F: 16 query rows a vector;
// score tiles of 8 keys x 48 rows and value tiles of 8 head dims x 48 rows (24 accumulators; the
// broadcasts fold into the FMAs as embedded broadcasts).
#include <immintrin.h>

#include "attention.h"
#include "avx512_math.h"
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
  static reg exp_nonpositive(reg x) { return exp_nonpositive_avx512(x); }  // avx512_math.h
  static void widen(const uint16_t* h, float* f, int64_t n) {
    for (int64_t i = 0; i < n; i += W)
      _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  }
};

}  // namespace

void extend_attention_avx512(const ExtendAttention& a, int64_t b, int64_t kvh, int64_t tok0, float* scratch) {
  extend_detail::extend_unit<Avx512>(a, b, kvh, tok0, scratch);
}

}  // namespace pds_cpu
