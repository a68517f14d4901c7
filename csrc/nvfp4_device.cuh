// Device helpers shared by the portable NVFP4 kernels: E2M1 rounding/decoding in software
// (sm_80 has no FP4 conversion instructions) and the SM120 scale-factor offset.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace pds {

// Round |v| to the nearest E2M1 magnitude code, ties to even, saturating at 6.
// NaN fails every comparison and lands on code 7 (6.0); callers must not rely on that.
__device__ __forceinline__ uint32_t e2m1_code(float v) {
  float a = fabsf(v);
  uint32_t c = a <= 0.25f ? 0u : a < 0.75f ? 1u : a <= 1.25f ? 2u : a < 1.75f ? 3u
             : a <= 2.5f ? 4u : a < 3.5f ? 5u : a <= 5.0f ? 6u : 7u;
  return c | (signbit(v) ? 8u : 0u);
}

// E2M1 code (low 4 bits of c) -> float.
__device__ __forceinline__ float e2m1_value(uint32_t c) {
  uint32_t e = (c >> 1) & 3u, m = c & 1u;
  float mag = e == 0 ? 0.5f * static_cast<float>(m) : __int_as_float(((e + 126u) << 23) | (m << 22));
  return (c & 8u) ? -mag : mag;
}

__device__ __forceinline__ float e4m3_value(uint8_t bits) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(bits), __NV_E4M3);
  return __half2float(__half(h));
}

__device__ __forceinline__ uint8_t e4m3_satfinite(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Byte offset of scale (row, kb) in the SM120 layout (128x4 atoms of 512 bytes).
__device__ __forceinline__ int64_t sf_offset(int row, int kb, int k_blocks) {
  int col_tiles = (k_blocks + 3) / 4;
  return (static_cast<int64_t>(row / 128) * col_tiles + kb / 4) * 512 + (row % 32) * 16 +
         ((row % 128) / 32) * 4 + kb % 4;
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

}  // namespace pds
