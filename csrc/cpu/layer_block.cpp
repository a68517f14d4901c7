// Fused blocks of a Llama-style decoder layer: one native call for each half of a layer, so a
// step makes 2 calls a layer instead of ~10 Python-dispatched ops (their overhead, not their
// arithmetic, was most of a small batch's non-matmul time, and ~10 % of a cached prompt's step).
// Any batch: decode rows (one new token a sequence) and prompt chunks over a cached prefix.
//
//   attention block: x += residual; h = rms_norm(x) * w; qkv = h . Wqkv^T; RoPE on q and k;
//                    k, v stored in the paged cache; paged attention (the decode kernel when
//                    every sequence has one new token, else the extend kernel); out = o . Wo^T
//   MLP block:       x += residual; h = rms_norm(x) * w; gu = h . Wgu^T; a = silu(g) * u;
//                    out = a . Wdown^T
//
// Each returns the row-parallel projection's output before any tensor-parallel sum: the caller
// all-reduces between the blocks, so TP > 1 runs the same calls. Every step is one of the
// library's tested kernels (qmatmul_f32, add_rms_norm_row, the decode and extend attention entries)
// or layer_ops.h.
// Compiled with baseline flags (it only calls the ISA units after `pick`).
#include <cstdint>
#include <cstring>
#include <vector>

#include "dispatch.h"
#include "layer_ops.h"
#include "norm.h"
#include "qgemm.h"
#include "scratch.h"

namespace pds_cpu {
namespace {

bool formats_ok(int a, int b) { return a >= Q4_0 && a <= Q8_0 && b >= Q4_0 && b <= Q8_0; }

// Per-call scratch reused across calls (one step calls each block once per layer).
thread_local std::vector<float> t_norm, t_mid, t_act;

// One projection: with int16-rounded activations when the weight is also packed (`qs` given),
// else on fp32 activations.
void project(const Kernels* k, int fmt, const uint8_t* w, const uint8_t* qs, const float* dm,
             const float* x, int64_t M, int64_t K, int64_t N, float* y, int threads) {
  if (qs != nullptr) {
    qmatmul_int16(Packed{qs, dm, K / QK, false}, x, M, K, N, y, threads);
  } else {
    qmatmul_f32(k, fmt, x, M, K, w, N, y, threads);
  }
}

void norm_rows(float* x, const float* residual, const float* w, float* out, int64_t rows,
               int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r)
    add_rms_norm_row_avx2(x + r * dim, residual ? residual + r * dim : nullptr, w, out + r * dim, dim, eps);
}

}  // namespace
}  // namespace pds_cpu

using namespace pds_cpu;

extern "C" int pds_cpu_paged_decode_attention(
    const float* q, int64_t q_stride, const void* k_cache, const void* v_cache, int kv_half,
    const int64_t* tables, int64_t table_stride, const int64_t* lens, int64_t B, int64_t heads,
    int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, float* out, int isa, int threads);
extern "C" int pds_cpu_paged_extend_attention(
    const float* q, int64_t q_stride, const void* k_cache, const void* v_cache, int kv_half,
    const int64_t* tables, int64_t table_stride, const int64_t* lens, const int64_t* starts, int64_t B,
    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, float* out, int isa, int threads);

extern "C" {

// x [M][hidden], M token rows (x += residual when residual is not null: x becomes the residual stream),
// weights in GGUF blocks, each also packed (qs, dm: qgemv_packed.h) or not (null) (qkv: (heads + 2 kv_heads) * head_dim rows of `hidden`; o: hidden rows
// of heads * head_dim), cos/sin [M][head_dim / 2], caches [blocks][block_size][kv_heads][head_dim]
// fp32, or fp16 where kv_half (head_dim a multiple of 16), slots [M] (block * block_size +
// offset of each new token), B sequences: tables
// [B][table_stride], lens [B] (context lengths, the new tokens included), starts [B + 1] (rows
// of sequence b: [starts[b], starts[b + 1]), M = starts[B]; null: one row a sequence, M = B),
// out [M][hidden]. Returns 0, 1 when the
// instruction set is unavailable, 2 for bad arguments.
__attribute__((visibility("default"))) int pds_cpu_attention_block(
    float* x, const float* residual, const float* norm_w, float eps, int qkv_fmt,
    const uint8_t* qkv_w, const uint8_t* qkv_qs, const float* qkv_dm, int o_fmt, const uint8_t* o_w,
    const uint8_t* o_qs, const float* o_dm, const float* cos, const float* sin,
    void* k_cache, void* v_cache, int kv_half, const int64_t* slots, const int64_t* tables,
    int64_t table_stride, const int64_t* lens, const int64_t* starts, int64_t B, int64_t hidden,
    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, float* out,
    int isa, int threads) {
  const Kernels* k = pick(isa);
  if (k == nullptr || ((qkv_qs || o_qs) && pick(ISA_AVX512) == nullptr)) return 1;
  const int64_t qkv_n = (heads + 2 * kv_heads) * head_dim, o_k = heads * head_dim;
  if (!formats_ok(qkv_fmt, o_fmt) || B < 0 || hidden <= 0 || hidden % QK || o_k % QK || kv_heads <= 0 ||
      heads % kv_heads || head_dim <= 0 || head_dim % 2 || block_size <= 0 || (kv_half && head_dim % 16))
    return 2;
  if (starts != nullptr && starts[0] != 0) return 2;
  const int64_t M = starts != nullptr ? starts[B] : B;  // token rows
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = starts != nullptr ? starts[b + 1] - starts[b] : 1;
    if (lens[b] <= 0 || n < 1 || n > lens[b]) return 2;
  }
  for (int64_t r = 0; r < M; ++r)
    if (slots[r] < 0) return 2;
  if (M == 0) return 0;
  float* h = aligned_scratch(t_norm, M * hidden);
  float* qkv = aligned_scratch(t_mid, M * qkv_n);
  float* att = aligned_scratch(t_act, M * o_k);
  norm_rows(x, residual, norm_w, h, M, hidden, eps);
  project(k, qkv_fmt, qkv_w, qkv_qs, qkv_dm, h, M, hidden, qkv_n, qkv, threads);
  const int64_t half = head_dim / 2, row = kv_heads * head_dim;
  for (int64_t r = 0; r < M; ++r) {  // RoPE on q and k (neighbours), then k and v into the cache
    float* t = qkv + r * qkv_n;
    rotary_halves_avx2(t, heads + kv_heads, head_dim, cos + r * half, sin + r * half);
    const float* k = t + heads * head_dim;
    const float* v = k + row;
    if (kv_half) {
      floats_to_half_avx2(k, static_cast<uint16_t*>(k_cache) + slots[r] * row, row);
      floats_to_half_avx2(v, static_cast<uint16_t*>(v_cache) + slots[r] * row, row);
    } else {
      std::memcpy(static_cast<float*>(k_cache) + slots[r] * row, k, row * sizeof(float));
      std::memcpy(static_cast<float*>(v_cache) + slots[r] * row, v, row * sizeof(float));
    }
  }
  // the attention entries the op-by-op path calls: one new token a sequence, the decode kernel
  const int status =
      M == B ? pds_cpu_paged_decode_attention(qkv, qkv_n, k_cache, v_cache, kv_half, tables, table_stride, lens, B,
                                              heads, kv_heads, head_dim, block_size, scale, att, isa, threads)
             : pds_cpu_paged_extend_attention(qkv, qkv_n, k_cache, v_cache, kv_half, tables, table_stride, lens,
                                              starts, B, heads, kv_heads, head_dim, block_size, scale, att, isa,
                                              threads);
  if (status) return status;
  project(k, o_fmt, o_w, o_qs, o_dm, att, M, o_k, hidden, out, threads);
  return 0;
}

// x [M][hidden] (x += residual as above), gate_up: 2 * inter rows of `hidden` (gate rows first),
// down: hidden rows of `inter`, out [M][hidden]. Returns 0, 1 or 2 as above.
__attribute__((visibility("default"))) int pds_cpu_mlp_block(
    float* x, const float* residual, const float* norm_w, float eps, int gu_fmt, const uint8_t* gu_w,
    const uint8_t* gu_qs, const float* gu_dm, int down_fmt, const uint8_t* down_w, const uint8_t* down_qs,
    const float* down_dm, int64_t M, int64_t hidden, int64_t inter, float* out,
    int isa, int threads) {
  const Kernels* k = pick(isa);
  if (k == nullptr || ((gu_qs || down_qs) && pick(ISA_AVX512) == nullptr)) return 1;
  if (!formats_ok(gu_fmt, down_fmt) || M < 0 || hidden <= 0 || hidden % QK || inter <= 0 || inter % QK)
    return 2;
  if (M == 0) return 0;
  float* h = aligned_scratch(t_norm, M * hidden);
  float* gu = aligned_scratch(t_mid, M * 2 * inter);
  float* act = aligned_scratch(t_act, M * inter);
  norm_rows(x, residual, norm_w, h, M, hidden, eps);
  project(k, gu_fmt, gu_w, gu_qs, gu_dm, h, M, hidden, 2 * inter, gu, threads);
  for (int64_t r = 0; r < M; ++r) silu_mul_avx2(gu + r * 2 * inter, gu + r * 2 * inter + inter, act + r * inter, inter);
  project(k, down_fmt, down_w, down_qs, down_dm, act, M, inter, hidden, out, threads);
  return 0;
}

}  // extern "C"
