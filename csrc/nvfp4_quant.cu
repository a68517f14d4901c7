// Activation quantization bf16 -> NVFP4 for the SM120 GEMM: packed E2M1 + swizzled E4M3
// scales. Portable (software rounding), so it can be checked on any GPU. One thread per
// 16-element block; threads on padding positions of the scale layout write zeros.
#include "common.cuh"
#include "nvfp4_device.cuh"

namespace {

__global__ void quantize_kernel(uint8_t* __restrict__ q, uint8_t* __restrict__ sf,
                                const uint4* __restrict__ x, const float* __restrict__ gs_dev,
                                float gs_host, int m, int k) {
  int k_blocks = k / 16;
  int cols_p = (k_blocks + 3) / 4 * 4;
  int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t rows_p = (m + 127) / 128 * 128;
  if (slot >= rows_p * cols_p) return;
  int row = static_cast<int>(slot / cols_p), kb = static_cast<int>(slot % cols_p);
  if (row >= m || kb >= k_blocks) {
    sf[pds::sf_offset(row, kb, k_blocks)] = 0;
    return;
  }
  float gs = gs_dev ? *gs_dev : gs_host;
  const uint4* src = x + (static_cast<int64_t>(row) * k + kb * 16) / 8;
  uint4 lo = src[0], hi = src[1];
  uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  float v[16];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = pds::bf16_lo(w[i]);
    v[2 * i + 1] = pds::bf16_hi(w[i]);
    amax = fmaxf(amax, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
  }
  // Same fp32 operation order as the torch reference: SF = e4m3((amax * gs) / 6).
  uint8_t sf_bits = pds::e4m3_satfinite(__fdiv_rn(__fmul_rn(amax, gs), 6.0f));
  float sf_val = pds::e4m3_value(sf_bits);
  float mult = sf_val > 0.0f ? __fdiv_rn(gs, sf_val) : 0.0f;
  uint32_t packed[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i)
    packed[i / 8] |= pds::e2m1_code(__fmul_rn(v[i], mult)) << (4 * (i % 8));
  *reinterpret_cast<uint2*>(q + (static_cast<int64_t>(row) * k + kb * 16) / 2) =
      make_uint2(packed[0], packed[1]);
  sf[pds::sf_offset(row, kb, k_blocks)] = sf_bits;
}

}  // namespace

extern "C" PDS_API int pds_nvfp4_quantize_bf16(void* q, void* sf, const void* x,
                                               const float* gs_dev, float gs, int m, int k,
                                               void* stream) {
  if (!q || !sf || !x || m <= 0 || k <= 0 || k % 16 != 0) return PDS_INVALID_ARGUMENT;
  if (!pds::aligned16(x) || (reinterpret_cast<uintptr_t>(q) & 7u)) return PDS_INVALID_ARGUMENT;
  int status = pds::check_device(pds::ArchSet::Portable);
  if (status != PDS_OK) return status;
  int64_t slots = static_cast<int64_t>((m + 127) / 128 * 128) * ((k / 16 + 3) / 4 * 4);
  int threads = 256;
  int64_t blocks = (slots + threads - 1) / threads;
  if (blocks > 0x7fffffff) return PDS_INVALID_ARGUMENT;
  quantize_kernel<<<static_cast<unsigned>(blocks), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint8_t*>(q), static_cast<uint8_t*>(sf), static_cast<const uint4*>(x), gs_dev,
      gs, m, k);
  return pds::launch_status();
}
