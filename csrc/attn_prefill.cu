// FA2-style varlen prefill attention (causal or not, GQA) on mma.sync, bf16.
// CTA = 4 warps = 64 query rows of one (sequence, q head); K/V tiles of 64 keys go through
// shared memory with cp.async, V(j) loading while S(j) is computed and K(j+1) while PV(j) is.
#include "attn_mma.cuh"
#include "common.cuh"

namespace {

using namespace pds::attn;
constexpr int kBlockM = 64, kBlockN = 64, kThreads = 128;

template <int D>
constexpr int smem_bytes() { return (kBlockM + 2 * kBlockN) * (D + 8) * 2; }

template <int D>
__global__ void __launch_bounds__(kThreads)
prefill_kernel(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
               const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
               const int* __restrict__ cu_q, const int* __restrict__ cu_k, int hq, int hkv,
               float scale_log2, int causal) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* sq = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  auto* sk = sq + kBlockM * (D + 8);
  auto* sv = sk + kBlockN * (D + 8);
  constexpr int ld = D + 8;

  int b = blockIdx.z, head = blockIdx.y, m0 = blockIdx.x * kBlockM;
  int q_start = cu_q[b], q_len = cu_q[b + 1] - q_start;
  int k_start = cu_k[b], k_len = cu_k[b + 1] - k_start;
  if (m0 >= q_len) return;
  int kv_head = head / (hq / hkv);
  int offset = k_len - q_len;  // bottom-right causal alignment
  int n_end = causal ? min(k_len, m0 + kBlockM + offset) : k_len;
  int64_t q_stride = static_cast<int64_t>(hq) * D, kv_stride = static_cast<int64_t>(hkv) * D;
  const __nv_bfloat16* q_base = q + (q_start + m0) * q_stride + head * D;
  const __nv_bfloat16* k_base = k + k_start * kv_stride + kv_head * D;
  const __nv_bfloat16* v_base = v + k_start * kv_stride + kv_head * D;

  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int row0 = m0 + warp * 16 + lane / 4;  // query index (within the sequence) of row h=0
  uint32_t qf[D / 16][4];
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  load_rows<D, kThreads>(sq, q_base, q_stride, kBlockM, q_len - m0);
  if (n_end > 0) load_rows<D, kThreads>(sk, k_base, kv_stride, kBlockN, n_end);
  cp_async_commit();
  for (int n0 = 0; n0 < n_end; n0 += kBlockN) {
    cp_async_wait_all();
    __syncthreads();  // K(n0) landed; every warp is done with V of the previous tile
    if (n0 == 0) load_q_frags<D>(qf, sq + warp * 16 * ld, ld);
    load_rows<D, kThreads>(sv, v_base + n0 * kv_stride, kv_stride, kBlockN, n_end - n0);
    cp_async_commit();

    float s[kBlockN / 8][4];
    qk_tile<D, kBlockN / 8>(s, qf, sk, ld);
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int key = n0 + 8 * j + 2 * (lane % 4) + (e % 2);
        int row = row0 + 8 * (e / 2);
        bool masked = key >= n_end || (causal && key > row + offset);
        s[j][e] = masked ? -INFINITY : s[j][e] * scale_log2;
      }
    softmax_tile<D, kBlockN / 8>(s, o, m, l);

    cp_async_wait_all();
    __syncthreads();  // V(n0) landed; every warp is done reading K(n0)
    if (n0 + kBlockN < n_end) {
      load_rows<D, kThreads>(sk, k_base + (n0 + kBlockN) * kv_stride, kv_stride, kBlockN, n_end - n0 - kBlockN);
      cp_async_commit();
    }
    pv_tile<D, kBlockN / 8>(o, s, sv, ld);
  }
  cp_async_wait_all();  // nothing in flight at exit, even when no key tile ran

  float totals[2] = {quad_sum(l[0]), quad_sum(l[1])};  // shuffles: all 32 lanes, no branch
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int row = row0 + 8 * h;
    if (row >= q_len) continue;
    float inv = totals[h] > 0.0f ? 1.0f / totals[h] : 0.0f;
    __nv_bfloat16* dst = out + (q_start + row) * q_stride + head * D + 2 * (lane % 4);
#pragma unroll
    for (int d = 0; d < D / 8; ++d)
      *reinterpret_cast<uint32_t*>(dst + 8 * d) = pack_bf16x2(o[d][2 * h] * inv, o[d][2 * h + 1] * inv);
  }
}

template <int D>
int launch(void* out, const void* q, const void* k, const void* v, const int* cu_q,
           const int* cu_k, int batch, int max_q, int hq, int hkv, float scale, int causal,
           cudaStream_t stream) {
  auto kernel = prefill_kernel<D>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<D>()) !=
      cudaSuccess)
    return PDS_LAUNCH_FAILED;
  dim3 grid((max_q + kBlockM - 1) / kBlockM, hq, batch);
  kernel<<<grid, kThreads, smem_bytes<D>(), stream>>>(
      static_cast<__nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(q),
      static_cast<const __nv_bfloat16*>(k), static_cast<const __nv_bfloat16*>(v), cu_q, cu_k, hq,
      hkv, scale * kLog2e, causal);
  return pds::launch_status();
}

}  // namespace

extern "C" PDS_API int pds_attn_prefill_bf16(void* out, const void* q, const void* k,
                                             const void* v, const int* cu_seqlens_q,
                                             const int* cu_seqlens_k, int batch,
                                             int max_seqlen_q, int num_q_heads,
                                             int num_kv_heads, int head_dim, float softmax_scale,
                                             int causal, void* stream) {
  if (!out || !q || !k || !v || !cu_seqlens_q || !cu_seqlens_k || batch <= 0 ||
      max_seqlen_q < 0 || num_q_heads <= 0 || num_kv_heads <= 0 ||
      num_q_heads % num_kv_heads != 0 || batch > 65535 || num_q_heads > 65535)
    return PDS_INVALID_ARGUMENT;
  if (!pds::aligned16(out) || !pds::aligned16(q) || !pds::aligned16(k) || !pds::aligned16(v))
    return PDS_INVALID_ARGUMENT;
  if (head_dim != 64 && head_dim != 128) return PDS_INVALID_ARGUMENT;
  int status = pds::check_device(pds::ArchSet::Portable);
  if (status != PDS_OK) return status;
  if (max_seqlen_q == 0) return PDS_OK;
  auto s = static_cast<cudaStream_t>(stream);
  return head_dim == 64
             ? launch<64>(out, q, k, v, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q,
                          num_q_heads, num_kv_heads, softmax_scale, causal, s)
             : launch<128>(out, q, k, v, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q,
                           num_q_heads, num_kv_heads, softmax_scale, causal, s);
}
