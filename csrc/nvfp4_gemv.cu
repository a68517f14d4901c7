// W4A16 NVFP4 GEMV / skinny GEMM on CUDA cores for decode (m <= 16). Portable: sm_80,
// sm_90a, sm_120a. Weights stay 4-bit in memory (the point of NVFP4 when decode is
// bandwidth-bound); they are decoded in registers and multiplied with bf16 activations in fp32.
//
// A warp owns kCols consecutive output columns; each lane reads 16 bytes (32 elements, two
// scale blocks) of each column per step, so the weight stream is fully coalesced.
#include "common.cuh"
#include "nvfp4_device.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kCols = 4;

template <int kRows>
__global__ void __launch_bounds__(kWarps * 32)
gemv_kernel(__nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,
            const uint8_t* __restrict__ w, const uint8_t* __restrict__ wsf, int sf_swizzled,
            float scale_2, int m, int n, int k) {
  int lane = threadIdx.x % 32;
  int col0 = (blockIdx.x * kWarps + threadIdx.x / 32) * kCols;
  if (col0 >= n) return;
  int k_blocks = k / 16;
  float acc[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;

  for (int k0 = lane * 32; k0 < k; k0 += 32 * 32) {
    uint4 wq[kCols];
    float s[kCols][2];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      int col = min(col0 + c, n - 1);  // clamp: duplicated columns are computed, not stored
      wq[c] = __ldg(reinterpret_cast<const uint4*>(w + (static_cast<int64_t>(col) * k + k0) / 2));
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        int kb = k0 / 16 + b;
        int64_t off = sf_swizzled ? pds::sf_offset(col, kb, k_blocks)
                                  : static_cast<int64_t>(col) * k_blocks + kb;
        s[c][b] = pds::e4m3_value(__ldg(wsf + off));
      }
    }
#pragma unroll
    for (int part = 0; part < 4; ++part) {  // 8 elements = one uint4 of x per part
      float wv[kCols][8];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        uint32_t bytes = part == 0 ? wq[c].x : part == 1 ? wq[c].y : part == 2 ? wq[c].z : wq[c].w;
#pragma unroll
        for (int e = 0; e < 8; ++e) wv[c][e] = pds::e2m1_value(bytes >> (4 * e)) * s[c][part / 2];
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < m) {
          uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(r) * k + k0 + part * 8));
          float xf[8] = {pds::bf16_lo(xv.x), pds::bf16_hi(xv.x), pds::bf16_lo(xv.y), pds::bf16_hi(xv.y),
                         pds::bf16_lo(xv.z), pds::bf16_hi(xv.z), pds::bf16_lo(xv.w), pds::bf16_hi(xv.w)};
#pragma unroll
          for (int c = 0; c < kCols; ++c)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][c] = fmaf(xf[e], wv[c][e], acc[r][c]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float v = acc[r][c];
#pragma unroll
      for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0 && r < m && col0 + c < n)
        y[static_cast<int64_t>(r) * n + col0 + c] = __float2bfloat16(v * scale_2);
    }
}

template <int kRows>
void launch(__nv_bfloat16* y, const __nv_bfloat16* x, const uint8_t* w, const uint8_t* wsf,
            int sf_swizzled, float scale_2, int m, int n, int k, cudaStream_t stream) {
  int cols_per_block = kWarps * kCols;
  gemv_kernel<kRows><<<(n + cols_per_block - 1) / cols_per_block, kWarps * 32, 0, stream>>>(
      y, x, w, wsf, sf_swizzled, scale_2, m, n, k);
}

}  // namespace

extern "C" PDS_API int pds_nvfp4_gemv_bf16(void* y, const void* x, const void* w,
                                           const void* wsf, int sf_swizzled,
                                           float weight_scale_2, int m, int n, int k,
                                           void* stream) {
  // k % 32: each lane step covers two whole scale blocks with one 16-byte load.
  if (!y || !x || !w || !wsf || m <= 0 || m > 16 || n <= 0 || k <= 0 || k % 32 != 0)
    return PDS_INVALID_ARGUMENT;
  if (!pds::aligned16(x) || !pds::aligned16(w)) return PDS_INVALID_ARGUMENT;
  int status = pds::check_device(pds::ArchSet::Portable);
  if (status != PDS_OK) return status;
  auto yb = static_cast<__nv_bfloat16*>(y);
  auto xb = static_cast<const __nv_bfloat16*>(x);
  auto wb = static_cast<const uint8_t*>(w);
  auto sb = static_cast<const uint8_t*>(wsf);
  auto s = static_cast<cudaStream_t>(stream);
  if (m <= 1) launch<1>(yb, xb, wb, sb, sf_swizzled, weight_scale_2, m, n, k, s);
  else if (m <= 2) launch<2>(yb, xb, wb, sb, sf_swizzled, weight_scale_2, m, n, k, s);
  else if (m <= 4) launch<4>(yb, xb, wb, sb, sf_swizzled, weight_scale_2, m, n, k, s);
  else if (m <= 8) launch<8>(yb, xb, wb, sb, sf_swizzled, weight_scale_2, m, n, k, s);
  else launch<16>(yb, xb, wb, sb, sf_swizzled, weight_scale_2, m, n, k, s);
  return pds::launch_status();
}
