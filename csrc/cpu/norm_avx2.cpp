// RMSNorm with the residual add fused in, fp32, compiled with AVX2 + FMA: per row, x += residual
// (written back: the caller's residual stream), then out = x * rsqrt(mean(x^2) + eps) * w, in one
// call instead of the seven small torch ops of `rms_norm` plus the add.
#include <cmath>
#include <cstdint>

#include "norm.h"

namespace pds_cpu {

void add_rms_norm_row_avx2(float* x, const float* residual, const float* w, float* out, int64_t dim,
                           float eps) {
  float ss = 0.0f;
  if (residual != nullptr) {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) {
      const float s = x[i] + residual[i];
      x[i] = s;
      ss += s * s;
    }
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) ss += x[i] * x[i];
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * inv * w[i];
}

}  // namespace pds_cpu
