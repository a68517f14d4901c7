// C ABI of the extend attention (attention.h): checks the arguments, picks the instruction set
// (compiled with baseline flags: no AVX instruction runs here before the check) and splits the
// units (sequence, KV head, tile of new tokens) over the helper pool (work_pool.h). Each unit is
// one thread's and writes its own output rows, so the result does not depend on the thread count.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "decode_split.h"
#include "dispatch.h"
#include "work_pool.h"

using namespace pds_cpu;

extern "C" {

// q [T][heads][head_dim] (token stride q_stride floats), caches [blocks][block_size][kv_heads]
// [head_dim] fp32, or fp16 where kv_half (head_dim a multiple of 16), tables [B][table_stride]
// int64, lens [B] int64 (context: cached + new),
// starts [B + 1] int64 (q rows of sequence b: [starts[b], starts[b + 1]), at most lens[b] of
// them), out [T][heads][head_dim]. isa: 0 auto, 1 AVX2, 2 AVX-512. Returns 0, 1 when the
// instruction set is unavailable, 2 for bad arguments.
__attribute__((visibility("default"))) int pds_cpu_paged_extend_attention(
    const float* q, int64_t q_stride, const void* k_cache, const void* v_cache, int kv_half,
    const int64_t* tables, int64_t table_stride, const int64_t* lens, const int64_t* starts,
    int64_t B, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
    float* out, int isa, int threads) {
  const Kernels* k = pick(isa);
  if (k == nullptr) return 1;
  if (B < 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0 || block_size <= 0 || starts[0] != 0)
    return 2;
  if (kv_half && head_dim % 16) return 2;
  const ExtendAttention a{q, q_stride, k_cache, v_cache, kv_half != 0, tables, table_stride, lens, starts, out,
                          heads, kv_heads, head_dim, block_size, scale};
  for (int64_t b = 0; b < B; ++b)
    if (starts[b + 1] - starts[b] < 0 || starts[b + 1] - starts[b] > lens[b]) return 2;
  // one new token (a decode row in a mixed batch): the decode kernel's units, the same arithmetic
  // as when the batch is all decode, so the token's result does not depend on its neighbours
  const auto is_row = [&](int64_t b) { return starts[b + 1] - starts[b] == 1; };
  const DecodeAttention one{q, q_stride, k_cache, v_cache, kv_half != 0, tables, table_stride, lens, out,
                            heads, kv_heads, head_dim, block_size, scale};
  const bool wide = k == &kAvx512;
  const bool share = wide && decode_avx512_covers(one);
  DecodeSplit split(one, B, is_row, share, threads);
  const auto row = [&](int64_t b) {  // decode row b as a batch of one: its q row is starts[b]
    DecodeAttention d = one;
    d.q = q + starts[b] * q_stride;
    d.out = out + starts[b] * heads * head_dim;
    d.tables = tables + b * table_stride;
    d.lens = lens + b;
    return d;
  };
  // the decode rows' units first, then each prompt chunk's (KV head, tile) units
  const int64_t per_tile = extend_tokens_per_tile(a);
  std::vector<int64_t> first_unit(B + 1, split.units());  // units before sequence b's tiles
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = starts[b + 1] - starts[b];
    first_unit[b + 1] = first_unit[b] + (is_row(b) ? 0 : (n + per_tile - 1) / per_tile * kv_heads);
  }
  const int64_t scratch_floats = std::max({extend_attention_scratch(a), decode_attention_scratch(one),
                                           share ? decode_rows_scratch(one) : 0});
  parallel_for_chunks(first_unit[B], threads, [&](int64_t u) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < scratch_floats) scratch.resize(scratch_floats);
    if (u < split.units()) {
      split.run(u, row, scratch.data(), wide);
      return;
    }
    const int64_t b = std::upper_bound(first_unit.begin(), first_unit.end(), u) - first_unit.begin() - 1;
    // a KV head's tiles are neighbours: a thread taking the next unit finds its K/V in cache
    const int64_t tiles = (first_unit[b + 1] - first_unit[b]) / kv_heads;
    const int64_t local = u - first_unit[b], kvh = local / tiles, tile = local % tiles;
    if (wide)
      extend_attention_avx512(a, b, kvh, tile * per_tile, scratch.data());
    else
      extend_attention_avx2(a, b, kvh, tile * per_tile, scratch.data());
  });
  return 0;
}

}  // extern "C"
