// Every decoder layer of a step in one native call, then the final RMSNorm: the fused
// blocks of layer_block.cpp called layer after layer with no Python between them (per layer, two
// ctypes calls with ~20-30 arguments and their checks cost ~50 us, several percent of a batch-1
// decode step). Only for models whose layers need no tensor-parallel sum between the blocks (TP = 1).
//
// The residual stream is kept as the op-by-op path keeps it: a layer's attention block reads
// (x, residual) and leaves x + residual in x; its MLP block reads (attention output, that sum).
// Three row buffers rotate: (x, residual, free) -> attention writes `free`, MLP writes into the
// residual's buffer -> (mlp out, attention out, old x).
// Compiled with baseline flags (it calls the other units only through their checked entries).
#include <cstdint>
#include <vector>

#include "dispatch.h"
#include "norm.h"
#include "qgemm.h"
#include "scratch.h"

extern "C" int pds_cpu_attention_block(
    float* x, const float* residual, const float* norm_w, float eps, int qkv_fmt, const uint8_t* qkv_w,
    const uint8_t* qkv_qs, const float* qkv_dm, int o_fmt, const uint8_t* o_w, const uint8_t* o_qs,
    const float* o_dm, const float* cos, const float* sin, void* k_cache, void* v_cache, int kv_half,
    const int64_t* slots, const int64_t* tables, int64_t table_stride, const int64_t* lens,
    const int64_t* starts, int64_t B, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t block_size, float scale, float* out, int isa, int threads);
extern "C" int pds_cpu_mlp_block(
    float* x, const float* residual, const float* norm_w, float eps, int gu_fmt, const uint8_t* gu_w,
    const uint8_t* gu_qs, const float* gu_dm, int down_fmt, const uint8_t* down_w, const uint8_t* down_qs,
    const float* down_dm, int64_t M, int64_t hidden, int64_t inter, float* out, int isa, int threads);

namespace pds_cpu {
namespace {

// One layer as the caller lays it out: 20 eight-byte fields (an int64 tensor [layers, 20] on
// the Python side). Projections in the order qkv, o, gate_up, down; `qs`/`dm` null unless the
// weight is packed for the int16 path (qgemv_packed.h).
struct StackedLayer {
  const float* attn_norm;
  const float* mlp_norm;
  const uint8_t* w[4];
  const uint8_t* qs[4];
  const float* dm[4];
  void* k_cache;  // fp32, or fp16 where the stack's kv_half
  void* v_cache;
  int64_t fmt[4];
};
static_assert(sizeof(StackedLayer) == 20 * 8, "the Python side packs 20 int64 per layer");

thread_local std::vector<float> t_rows;

}  // namespace
}  // namespace pds_cpu

using namespace pds_cpu;

extern "C" {

// x [M][hidden]: the embedded tokens (overwritten: used as a buffer); layers[n_layers]; the step's
// cos/sin, slots, tables, lens, starts and every layer's cache type (kv_half) as in
// pds_cpu_attention_block; out [M][hidden] = the final
// norm of the last layer's residual stream (final_w, eps). Returns the first failing block's
// status (1 instruction set unavailable, 2 bad arguments), 0 when done.
__attribute__((visibility("default"))) int pds_cpu_fused_layers(
    const StackedLayer* layers, int64_t n_layers, float* x, const float* final_w, float eps,
    const float* cos, const float* sin, int kv_half, const int64_t* slots, const int64_t* tables,
    int64_t table_stride, const int64_t* lens, const int64_t* starts, int64_t B, int64_t hidden, int64_t heads,
    int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t inter, float scale, float* out, int isa, int threads) {
  if (n_layers <= 0 || B < 0 || hidden <= 0 || (starts != nullptr && starts[0] != 0)) return 2;
  if (pick(isa) == nullptr) return 1;
  const int64_t M = starts != nullptr ? starts[B] : B;  // token rows
  if (M == 0) return 0;
  float* cur = x;                      // the layer's input
  float* res = nullptr;                // its residual (none before the first layer)
  float* free_rows = aligned_scratch(t_rows, 2 * M * hidden);
  float* spare = free_rows + M * hidden;
  for (int64_t l = 0; l < n_layers; ++l) {
    const StackedLayer& L = layers[l];
    int status = pds_cpu_attention_block(
        cur, res, L.attn_norm, eps, static_cast<int>(L.fmt[0]), L.w[0], L.qs[0], L.dm[0],
        static_cast<int>(L.fmt[1]), L.w[1], L.qs[1], L.dm[1], cos, sin, L.k_cache, L.v_cache, kv_half, slots, tables,
        table_stride, lens, starts, B, hidden, heads, kv_heads, head_dim, block_size, scale, free_rows, isa, threads);
    if (status) return status;
    float* mlp_out = res ? res : spare;  // the old residual was just added into cur
    status = pds_cpu_mlp_block(
        free_rows, cur, L.mlp_norm, eps, static_cast<int>(L.fmt[2]), L.w[2], L.qs[2], L.dm[2],
        static_cast<int>(L.fmt[3]), L.w[3], L.qs[3], L.dm[3], M, hidden, inter, mlp_out, isa, threads);
    if (status) return status;
    // (cur, res, free) -> (mlp out, attention out + cur, cur's buffer)
    float* old = cur;
    cur = mlp_out;
    res = free_rows;
    free_rows = old;
    if (mlp_out == spare) spare = nullptr;  // from now on the three buffers rotate
  }
  for (int64_t r = 0; r < M; ++r)
    add_rms_norm_row_avx2(cur + r * hidden, res + r * hidden, final_w, out + r * hidden, hidden, eps);
  return 0;
}

}  // extern "C"
