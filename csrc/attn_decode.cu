// Split-KV paged decode attention (one query token per sequence, GQA) on mma.sync, bf16.
// A CTA takes one (split, kv head, group of <= 16 q heads, sequence): the group's q heads
// are the 16 mma rows, so GQA turns decode into a small matrix product. Key tiles of 64 are
// gathered from the paged cache through the block table; warp w computes keys 16w..16w+15
// of each tile with its own running softmax state, and the four states are merged at the end.
// With several splits each writes fp32 partials + log2-sum-exp, and combine_kernel reduces.
#include "attn_mma.cuh"
#include "common.cuh"

namespace {

using namespace pds::attn;
constexpr int kRows = 16, kTile = 64, kWarps = 4, kThreads = kWarps * 32;

template <int D>
constexpr int smem_bytes() { return (kRows + 2 * kTile) * (D + 8) * 2; }
static_assert(kWarps * kRows * 128 * 4 <= 2 * kTile * (128 + 8) * 2, "merge slabs fit in K/V");

// Gather keys [n0, n0+64) of one kv head from the paged cache; keys >= end are zero-filled.
template <int D>
__device__ __forceinline__ void load_paged(__nv_bfloat16* dst, const __nv_bfloat16* cache,
                                           const int* table, int block_size, int hkv, int kvh,
                                           int n0, int end) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < kTile * kChunks; i += kThreads) {
    int r = i / kChunks, c = i % kChunks, pos = n0 + r;
    bool ok = pos < end;
    int64_t slot = ok ? static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size : 0;
    cp_async16(dst + r * (D + 8) + c * 8, cache + (slot * hkv + kvh) * D + c * 8, ok);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads)
decode_kernel(__nv_bfloat16* __restrict__ out, float* __restrict__ part_o,
              float* __restrict__ part_lse, const __nv_bfloat16* __restrict__ q,
              const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
              const int* __restrict__ block_tables, const int* __restrict__ context_lens,
              int batch, int hq, int hkv, int block_size, int max_blocks, float scale_log2) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float s_m[kWarps][kRows], s_l[kWarps][kRows], s_max[kRows], s_sum[kRows];
  constexpr int ld = D + 8;
  auto* sq = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  auto* sk = sq + kRows * ld;
  auto* sv = sk + kTile * ld;

  int split = blockIdx.x, num_splits = gridDim.x, b = blockIdx.z;
  int group = hq / hkv, groups16 = (group + kRows - 1) / kRows;
  int kvh = blockIdx.y / groups16, head0 = kvh * group + (blockIdx.y % groups16) * kRows;
  int rows = min(kRows, kvh * group + group - head0);
  int len = context_lens[b];
  int chunk = ((len + num_splits - 1) / num_splits + kTile - 1) / kTile * kTile;
  int start = split * chunk, end = min(len, start + chunk);
  const int* table = block_tables + static_cast<int64_t>(b) * max_blocks;

  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t qf[D / 16][4];
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  load_rows<D, kThreads>(sq, q + (static_cast<int64_t>(b) * hq + head0) * D, D, kRows, rows);
  if (start < end) load_paged<D>(sk, k_cache, table, block_size, hkv, kvh, start, end);
  cp_async_commit();
  for (int n0 = start; n0 < end; n0 += kTile) {
    cp_async_wait_all();
    __syncthreads();
    if (n0 == start) load_q_frags<D>(qf, sq, ld);
    load_paged<D>(sv, v_cache, table, block_size, hkv, kvh, n0, end);
    cp_async_commit();

    float s[2][4];
    qk_tile<D, 2>(s, qf, sk + warp * 16 * ld, ld);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int key = n0 + warp * 16 + 8 * j + 2 * (lane % 4) + (e % 2);
        s[j][e] = key < end ? s[j][e] * scale_log2 : -INFINITY;
      }
    softmax_tile<D, 2>(s, o, m, l);

    cp_async_wait_all();
    __syncthreads();
    if (n0 + kTile < end) {
      load_paged<D>(sk, k_cache, table, block_size, hkv, kvh, n0 + kTile, end);
      cp_async_commit();
    }
    pv_tile<D, 2>(o, s, sv + warp * 16 * ld, ld);
  }
  cp_async_wait_all();

  // Merge the four warps' states: row max, then weights 2^(m_w - max) / sum.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = quad_sum(l[h]);
    if (lane % 4 == 0) {
      s_m[warp][lane / 4 + 8 * h] = m[h];
      s_l[warp][lane / 4 + 8 * h] = total;
    }
  }
  __syncthreads();  // also: every warp is done with K/V, so the slabs may overwrite them
  if (threadIdx.x < kRows) {
    int r = threadIdx.x;
    float mx = -INFINITY, sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][r]);
    for (int w = 0; w < kWarps; ++w)
      if (s_m[w][r] != -INFINITY) sum += s_l[w][r] * exp2f(s_m[w][r] - mx);
    s_max[r] = mx;
    s_sum[r] = sum;
  }
  __syncthreads();
  float* slab = reinterpret_cast<float*>(sk);  // [kWarps][kRows][D]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int r = lane / 4 + 8 * h;
    float f = (m[h] == -INFINITY || s_sum[r] == 0.0f) ? 0.0f : exp2f(m[h] - s_max[r]) / s_sum[r];
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      int col = 8 * d + 2 * (lane % 4);
      slab[(warp * kRows + r) * D + col] = o[d][2 * h] * f;
      slab[(warp * kRows + r) * D + col + 1] = o[d][2 * h + 1] * f;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * D; i += kThreads) {
    int r = i / D, col = i % D;
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc += slab[(w * kRows + r) * D + col];
    int64_t row = static_cast<int64_t>(b) * hq + head0 + r;
    if (num_splits == 1) {
      out[row * D + col] = __float2bfloat16(acc);
    } else {
      part_o[(static_cast<int64_t>(split) * batch * hq + row) * D + col] = acc;
      if (col == 0)
        part_lse[static_cast<int64_t>(split) * batch * hq + row] =
            s_sum[r] > 0.0f ? s_max[r] + log2f(s_sum[r]) : -INFINITY;
    }
  }
}

// out[b, h, :] = sum_s 2^(lse_s - max) O_s / sum_s 2^(lse_s - max); one CTA per (b, h).
__global__ void combine_kernel(__nv_bfloat16* __restrict__ out, const float* __restrict__ part_o,
                               const float* __restrict__ part_lse, int rows_total, int num_splits,
                               int d) {
  int64_t row = blockIdx.x;
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, part_lse[s * static_cast<int64_t>(rows_total) + row]);
  for (int col = threadIdx.x; col < d; col += blockDim.x) {
    float acc = 0.0f, wsum = 0.0f;
    if (mx != -INFINITY) {
      for (int s = 0; s < num_splits; ++s) {
        float lse = part_lse[s * static_cast<int64_t>(rows_total) + row];
        float w = lse == -INFINITY ? 0.0f : exp2f(lse - mx);
        acc += w * part_o[(s * static_cast<int64_t>(rows_total) + row) * d + col];
        wsum += w;
      }
    }
    out[row * d + col] = __float2bfloat16(wsum > 0.0f ? acc / wsum : 0.0f);
  }
}

template <int D>
int launch(void* out, const void* q, const void* kc, const void* vc, const int* tables,
           const int* lens, int batch, int hq, int hkv, int block_size, int max_blocks,
           float scale, int splits, void* workspace, cudaStream_t stream) {
  auto kernel = decode_kernel<D>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<D>()) !=
      cudaSuccess)
    return PDS_LAUNCH_FAILED;
  int groups16 = (hq / hkv + kRows - 1) / kRows;
  int64_t rows_total = static_cast<int64_t>(batch) * hq;
  auto* part_o = static_cast<float*>(workspace);
  float* part_lse = part_o ? part_o + splits * rows_total * D : nullptr;
  dim3 grid(splits, hkv * groups16, batch);
  kernel<<<grid, kThreads, smem_bytes<D>(), stream>>>(
      static_cast<__nv_bfloat16*>(out), part_o, part_lse, static_cast<const __nv_bfloat16*>(q),
      static_cast<const __nv_bfloat16*>(kc), static_cast<const __nv_bfloat16*>(vc), tables, lens,
      batch, hq, hkv, block_size, max_blocks, scale * kLog2e);
  if (splits > 1)
    combine_kernel<<<static_cast<unsigned>(rows_total), D, 0, stream>>>(
        static_cast<__nv_bfloat16*>(out), part_o, part_lse, static_cast<int>(rows_total), splits, D);
  return pds::launch_status();
}

}  // namespace

extern "C" {

PDS_API int64_t pds_attn_decode_workspace_bytes(int batch, int num_q_heads, int head_dim,
                                                int num_splits) {
  if (batch <= 0 || num_q_heads <= 0 || head_dim <= 0 || num_splits <= 0) return -1;
  if (num_splits == 1) return 0;
  return static_cast<int64_t>(num_splits) * batch * num_q_heads * (head_dim + 1) * 4;
}

PDS_API int pds_attn_decode_paged_bf16(void* out, const void* q, const void* k_cache,
                                       const void* v_cache, const int* block_tables,
                                       const int* context_lens, int batch, int num_q_heads,
                                       int num_kv_heads, int head_dim, int block_size,
                                       int max_blocks_per_seq, float softmax_scale,
                                       int num_splits, void* workspace, size_t workspace_bytes,
                                       void* stream) {
  if (!out || !q || !k_cache || !v_cache || !block_tables || !context_lens || batch <= 0 ||
      batch > 65535 || num_q_heads <= 0 || num_kv_heads <= 0 ||
      num_q_heads % num_kv_heads != 0 || block_size <= 0 || max_blocks_per_seq <= 0 ||
      num_splits <= 0 || num_splits > 65535)
    return PDS_INVALID_ARGUMENT;
  if (head_dim != 64 && head_dim != 128) return PDS_INVALID_ARGUMENT;
  if (!pds::aligned16(out) || !pds::aligned16(q) || !pds::aligned16(k_cache) ||
      !pds::aligned16(v_cache))
    return PDS_INVALID_ARGUMENT;
  int64_t need = pds_attn_decode_workspace_bytes(batch, num_q_heads, head_dim, num_splits);
  if (static_cast<int64_t>(workspace_bytes) < need || (need > 0 && !workspace))
    return PDS_WORKSPACE_TOO_SMALL;
  int status = pds::check_device(pds::ArchSet::Portable);
  if (status != PDS_OK) return status;
  auto s = static_cast<cudaStream_t>(stream);
  return head_dim == 64
             ? launch<64>(out, q, k_cache, v_cache, block_tables, context_lens, batch,
                          num_q_heads, num_kv_heads, block_size, max_blocks_per_seq,
                          softmax_scale, num_splits, workspace, s)
             : launch<128>(out, q, k_cache, v_cache, block_tables, context_lens, batch,
                           num_q_heads, num_kv_heads, block_size, max_blocks_per_seq,
                           softmax_scale, num_splits, workspace, s);
}

}  // extern "C"
