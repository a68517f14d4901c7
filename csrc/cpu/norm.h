// Fused residual add + RMSNorm on the CPU (fp32 rows).
#pragma once
#include <cstdint>

namespace pds_cpu {

// One row of `dim`: x += residual when residual is not null (x keeps the sum), then
// out = x / sqrt(mean(x^2) + eps) * w.
void add_rms_norm_row_avx2(float* x, const float* residual, const float* w, float* out, int64_t dim,
                           float eps);

}  // namespace pds_cpu
