// Public C ABI of libpdserve_kernels.so (loaded by pdserve_kernels/cuda_lib.py through ctypes).
// Every entry returns a pds_status; pointers are raw device pointers; `stream` is a
// cudaStream_t passed as void* so this header needs no CUDA include.
#pragma once
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define PDS_API __attribute__((visibility("default")))
#else
#define PDS_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum pds_status {
  PDS_OK = 0,
  PDS_NO_DEVICE = 1,          // no CUDA driver or no GPU
  PDS_UNSUPPORTED_ARCH = 2,   // the current GPU cannot run this kernel (e.g. GEMM off SM120)
  PDS_INVALID_ARGUMENT = 3,   // shape, alignment or null pointer
  PDS_WORKSPACE_TOO_SMALL = 4,
  PDS_CANNOT_IMPLEMENT = 5,   // CUTLASS refused the problem
  PDS_LAUNCH_FAILED = 6,      // a CUDA error at launch
};

// ---- host-only helpers (work without a GPU) ------------------------------------------
PDS_API const char* pds_status_name(int status);
PDS_API int pds_abi_version(void);
// Device check: 0 when a GPU with compute capability `major.minor` is current.
PDS_API int pds_device_capability(int* major, int* minor);
// Swizzled block-scale buffer size in bytes for a [rows, k] NVFP4 operand (SM120 layout).
PDS_API int64_t pds_nvfp4_sf_bytes(int64_t rows, int64_t k);
// Byte offset of scale (row, kblock) in that layout, as CuTe computes it.
PDS_API int64_t pds_nvfp4_sf_offset(int64_t rows, int64_t k, int64_t row, int64_t kblock);
// Workspace the block-scaled GEMM needs (bytes, may be 0); -1 when built without it.
PDS_API int64_t pds_nvfp4_gemm_workspace_bytes(int m, int n, int k);
// Workspace of the split-KV decode (fp32 partial outputs + LSE).
PDS_API int64_t pds_attn_decode_workspace_bytes(int batch, int num_q_heads, int head_dim,
                                                int num_splits);

// ---- launches ------------------------------------------------------------------------
// D[m,n] (bf16, row-major) = alpha * (A ⊙ SFA)[m,k] · (B ⊙ SFB)[n,k]^T.
// A, B: packed E2M1 (even element in the low nibble), K-major. SFA/SFB: swizzled E4M3.
// alpha_dev: device float (nullable: then `alpha` is used). SM120 only.
PDS_API int pds_nvfp4_gemm_bf16(void* d, const void* a, const void* b, const void* sfa,
                                const void* sfb, const float* alpha_dev, float alpha, int m,
                                int n, int k, void* workspace, size_t workspace_bytes,
                                void* stream);

// x[m,k] bf16 -> q[m,k/2] packed E2M1 + sf (swizzled E4M3, pds_nvfp4_sf_bytes(m,k) bytes,
// padding written as 0). gs_dev: device float = 1/input_scale (nullable: then `gs`).
PDS_API int pds_nvfp4_quantize_bf16(void* q, void* sf, const void* x, const float* gs_dev,
                                    float gs, int m, int k, void* stream);

// y[m,n] bf16 = x[m,k] bf16 · dequant(W)[n,k]^T on CUDA cores, m <= 16 (W4A16).
// w: packed [n,k/2]; wsf: E4M3 scales, linear [n,k/16] or swizzled (sf_swizzled != 0);
// weight_scale_2 multiplies every output. Any GPU with sm_80+.
PDS_API int pds_nvfp4_gemv_bf16(void* y, const void* x, const void* w, const void* wsf,
                                int sf_swizzled, float weight_scale_2, int m, int n, int k,
                                void* stream);

// Varlen causal/non-causal prefill, GQA. q [total_q, hq, d], k/v [total_k, hkv, d], out like q.
// cu_seqlens_q/k: int32 [batch+1]. Causal masks bottom-right aligned (queries are the last
// q_len positions of their k_len keys). head_dim 64 or 128, bf16.
PDS_API int pds_attn_prefill_bf16(void* out, const void* q, const void* k, const void* v,
                                  const int* cu_seqlens_q, const int* cu_seqlens_k, int batch,
                                  int max_seqlen_q, int num_q_heads, int num_kv_heads,
                                  int head_dim, float softmax_scale, int causal, void* stream);

// Split-KV paged decode, one query token per sequence. q/out [batch, hq, d];
// k_cache/v_cache [num_blocks, block_size, hkv, d]; block_tables int32 [batch, max_blocks];
// context_lens int32 [batch]. num_splits >= 1 (fixed by the caller, so a CUDA graph can
// capture it); with num_splits > 1 the workspace must hold
// pds_attn_decode_workspace_bytes(batch, hq, d, num_splits) bytes.
PDS_API int pds_attn_decode_paged_bf16(void* out, const void* q, const void* k_cache,
                                       const void* v_cache, const int* block_tables,
                                       const int* context_lens, int batch, int num_q_heads,
                                       int num_kv_heads, int head_dim, int block_size,
                                       int max_blocks_per_seq, float softmax_scale,
                                       int num_splits, void* workspace, size_t workspace_bytes,
                                       void* stream);

#ifdef __cplusplus
}
#endif
