// The small elementwise steps of a decoder layer, for the fused layer blocks (layer_block.cpp):
// rotary embedding on q and k heads, SwiGLU, and K/V rows rounded to fp16 for an fp16 cache.
// fp32 rows, compiled with AVX2 + FMA + F16C.
#pragma once
#include <cstdint>

namespace pds_cpu {

// Rotate-half RoPE in place on `heads` heads of `head_dim` (even) floats, side by side in `x`:
// with x1, x2 a head's halves, x1 <- x1*cos - x2*sin and x2 <- x2*cos + x1*sin (cos, sin:
// head_dim / 2 values for this token, shared by every head).
void rotary_halves_avx2(float* x, int64_t heads, int64_t head_dim, const float* cos, const float* sin);

// dst[i] = src[i] as IEEE fp16, rounded to nearest even (as torch's float -> half), for i < n.
void floats_to_half_avx2(const float* src, uint16_t* dst, int64_t n);

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i], for i < n.
void silu_mul_avx2(const float* gate, const float* up, float* out, int64_t n);

}  // namespace pds_cpu
