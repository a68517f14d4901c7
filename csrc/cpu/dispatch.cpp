// C ABI of libpdserve_cpu.so: picks the instruction set at run time (cpuid, or forced by the
// caller) and splits the work over the helper pool (work_pool.h). Compiled with baseline flags:
// no AVX instruction may run here before the check. The caller passes the thread count. No
// entry uses OpenMP: a team's threads spin for milliseconds after each region, on the very
// cores the pool's helpers need next (docs/cpu-threads.md).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "decode_split.h"
#include "dispatch.h"
#include "norm.h"
#include "qgemm.h"
#include "scratch.h"
#include "work_pool.h"

namespace pds_cpu {
namespace {

constexpr int64_t kRowsPerChunk = 16;   // output features per unit of work
constexpr int64_t kActRowsPerPass = 64;  // activation rows kept hot in cache while N is swept

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool has_avx512() {
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

}  // namespace

const Kernels* pick(int isa) {
  switch (isa) {
    case ISA_AUTO: return has_avx512() ? &kAvx512 : has_avx2() ? &kAvx2 : nullptr;
    case ISA_AVX2: return has_avx2() ? &kAvx2 : nullptr;
    case ISA_AVX512: return has_avx512() ? &kAvx512 : nullptr;
    default: return nullptr;
  }
}

// Output features per unit of work for the helper pool: at least kRowsPerChunk, and about 8
// units per thread, so a large matrix (the LM head) is a few long runs of consecutive rows.
int64_t rows_per_unit(int64_t N, int threads) {
  const int64_t per = N / (kRowsPerChunk * std::max(1, threads) * 8);
  return kRowsPerChunk * std::max<int64_t>(1, per);
}

void qmatmul_f32(const Kernels* k, int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w,
                 int64_t N, float* y, int threads) {
  if (M >= k->panel_min_rows) {
    const int64_t panels = (N + NR - 1) / NR;
    parallel_for_chunks(panels, threads, [&](int64_t p) {
      thread_local std::vector<float> panel;
      if (static_cast<int64_t>(panel.size()) < K * NR) panel.resize(K * NR);
      const int rows = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
      k->gemm_f32(fmt, x, M, K, w, p * NR, rows, panel.data(), y, N);
    });
    return;
  }
  const int64_t unit = rows_per_unit(N, threads);
  parallel_for_chunks((N + unit - 1) / unit, threads, [&](int64_t c) {
    k->gemm_dot(fmt, x, M, K, w, y, N, c * unit, std::min(N, (c + 1) * unit));
  });
}

namespace {

// Activation rows per unit of work of the packed product: a block of rows stays in cache while a
// unit sweeps its panels (64 rows of 1536 int16 values: 192 KB).
constexpr int64_t kPackedRowsPerUnit = 64;

}  // namespace

void qmatmul_int16(const Packed& w, const float* x, int64_t M, int64_t K, int64_t N, float* y, int threads) {
  thread_local std::vector<int16_t> act;
  thread_local std::vector<float> scales;
  const int64_t nb = K / QK;
  int16_t* a = aligned_scratch(act, M * K);
  float* da = aligned_scratch(scales, 2 * M * nb);
  float* xs = da + M * nb;
  packed_prepare_avx512(x, M, K, a, da, xs);
  const int64_t panels = (N + kPanelRows - 1) / kPanelRows;
  const int64_t per_unit = rows_per_unit(N, threads) / kPanelRows;
  const int64_t col_units = (panels + per_unit - 1) / per_unit;
  const int64_t row_units = (M + kPackedRowsPerUnit - 1) / kPackedRowsPerUnit;
  parallel_for_chunks(row_units * col_units, threads, [&](int64_t u) {
    const int64_t m0 = u / col_units * kPackedRowsPerUnit, p0 = u % col_units * per_unit;
    packed_gemm_avx512(w, a, da, xs, m0, std::min(M, m0 + kPackedRowsPerUnit), N, y, N, p0,
                       std::min(panels, p0 + per_unit));
  });
}

}  // namespace pds_cpu

using namespace pds_cpu;

extern "C" {

__attribute__((visibility("default"))) int pds_cpu_abi_version() { return 15; }

// The instruction set `isa` (0 auto) resolves to on this CPU: 1 AVX2, 2 AVX-512 VNNI, 0 none.
__attribute__((visibility("default"))) int pds_cpu_isa(int isa) {
  const Kernels* k = pick(isa);
  return k == &kAvx512 ? ISA_AVX512 : k == &kAvx2 ? ISA_AVX2 : 0;
}

// y[M][N] = x[M][K] . dequant(w)[N][K]^T, x fp32 row-major, w N rows of K/32 GGUF blocks of
// `fmt`, y fp32 row-major; `path` (Path) how activations enter. Returns 0, or 1 when the
// instruction set is unavailable, 2 for bad arguments.
__attribute__((visibility("default"))) int pds_cpu_qmatmul(int fmt, const float* x, int64_t M,
                                                           int64_t K, const uint8_t* w, int64_t N,
                                                           float* y, int isa, int threads, int path) {
  const Kernels* k = pick(isa);
  if (k == nullptr) return 1;
  if (fmt < Q4_0 || fmt > Q8_0 || M < 0 || N < 0 || K <= 0 || K % QK || path < 0 || path > 2) return 2;
  if (M == 0 || N == 0) return 0;
  if (path != PATH_INT8) {
    qmatmul_f32(k, fmt, x, M, K, w, N, y, threads);
    return 0;
  }
  const int64_t nb = K / QK;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * nb), s(M * nb);
  const QuantAct act{q.data(), d.data(), s.data(), K};
  const int64_t chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  parallel_for_chunks(M, threads, [&](int64_t m) {
    k->quantize_row(x + m * K, K, q.data() + m * K, d.data() + m * nb, s.data() + m * nb);
  });
  for (int64_t m0 = 0; m0 < M; m0 += kActRowsPerPass) {
    const int64_t m1 = std::min(M, m0 + kActRowsPerPass);
    parallel_for_chunks(chunks, threads, [&](int64_t c) {
      const int64_t n0 = c * kRowsPerChunk, n1 = std::min(N, n0 + kRowsPerChunk);
      k->gemm(fmt, act, w, y, N, m0, m1, n0, n1);
    });
  }
  return 0;
}

// y[M][N] = x'[M][K] . dequant(W)^T for x' the rows rounded to int16 per block of 32 and W a
// `fmt` matrix packed for the int16 path (qgemv_packed.h: Q4_0/Q4_1 qs [P][K/32][256], dm
// [P][K/32][32]; Q8_0 qs [P][K/32][512], dm [P][K/32][16]; P = ceil(N / 16)). AVX-512 VNNI only.
// Returns 0, 1 when AVX-512 is unavailable, 2 for bad arguments.
__attribute__((visibility("default"))) int pds_cpu_qmatmul_packed(int fmt, const float* x, int64_t M, int64_t K,
                                                                  const uint8_t* qs, const float* dm,
                                                                  int64_t N, float* y, int threads) {
  if (pick(ISA_AVX512) == nullptr) return 1;
  if (fmt < Q4_0 || fmt > Q8_0 || qs == nullptr || dm == nullptr || M < 0 || N < 0 || K <= 0 || K % QK) return 2;
  if (M == 0 || N == 0) return 0;
  qmatmul_int16(Packed{qs, dm, K / QK, fmt == Q8_0}, x, M, K, N, y, threads);
  return 0;
}

// out[M][K] = x rounded to int16 per block of 32 exactly as the packed product rounds it
// (qgemv_packed.h: da * q, as fp32), so tests can hold that rounding to the torch reference bit
// for bit. AVX-512 only. Returns 0, 1 when AVX-512 is unavailable, 2 for bad arguments.
__attribute__((visibility("default"))) int pds_cpu_round_int16(const float* x, int64_t M, int64_t K,
                                                               float* out) {
  if (pick(ISA_AVX512) == nullptr) return 1;
  if (M < 0 || K <= 0 || K % QK) return 2;
  std::vector<int16_t> a(M * K);
  std::vector<float> da(M * K / QK), xs(M * K / QK);
  packed_prepare_avx512(x, M, K, a.data(), da.data(), xs.data());
  for (int64_t i = 0; i < M * K; ++i) out[i] = da[i / QK] * static_cast<float>(a[i]);
  return 0;
}

// out[N][K] fp32 = the N rows of blocks w dequantized (prefill hands them to torch's GEMM).
__attribute__((visibility("default"))) int pds_cpu_dequantize(int fmt, const uint8_t* w, int64_t N,
                                                              int64_t K, float* out, int isa,
                                                              int threads) {
  const Kernels* k = pick(isa);
  if (k == nullptr) return 1;
  if (fmt < Q4_0 || fmt > Q8_0 || N < 0 || K <= 0 || K % QK) return 2;
  const int64_t chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  parallel_for_chunks(chunks, threads, [&](int64_t c) {
    const int64_t n0 = c * kRowsPerChunk, n1 = std::min(N, n0 + kRowsPerChunk);
    k->dequantize(fmt, w, K, n0, n1, out + n0 * K);
  });
  return 0;
}

// Decode attention over the paged cache (attention.h): q [B][heads][head_dim] (token stride
// q_stride floats), caches [blocks][block_size][kv_heads][head_dim] fp32, or fp16 where kv_half
// (head_dim a multiple of 16), tables [B][table_stride] int64, lens [B] int64 (each >= 1), out
// [B][heads][head_dim]. One unit of work per (sequence, KV head); `isa` as for the matmuls.
// Returns 0, 1 when the instruction set is unavailable, 2 for bad arguments.
__attribute__((visibility("default"))) int pds_cpu_paged_decode_attention(
    const float* q, int64_t q_stride, const void* k_cache, const void* v_cache, int kv_half,
    const int64_t* tables, int64_t table_stride, const int64_t* lens, int64_t B, int64_t heads,
    int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, float* out, int isa, int threads) {
  const Kernels* k = pick(isa);
  if (k == nullptr) return 1;
  if (B < 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0 || block_size <= 0) return 2;
  if (kv_half && head_dim % 16) return 2;
  for (int64_t b = 0; b < B; ++b)
    if (lens[b] <= 0) return 2;
  const DecodeAttention a{q, q_stride, k_cache, v_cache, kv_half != 0, tables, table_stride, lens, out,
                          heads, kv_heads, head_dim, block_size, scale};
  const bool wide = k == &kAvx512, share = wide && decode_avx512_covers(a);
  DecodeSplit split(a, B, [](int64_t) { return true; }, share, threads);
  const int64_t scratch_floats = std::max(decode_attention_scratch(a), share ? decode_rows_scratch(a) : 0);
  const auto row = [&](int64_t b) {  // row b as a batch of one
    DecodeAttention d = a;
    d.q = q + b * q_stride;
    d.out = out + b * heads * head_dim;
    d.tables = tables + b * table_stride;
    d.lens = lens + b;
    return d;
  };
  parallel_for_chunks(split.units(), threads, [&](int64_t u) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < scratch_floats) scratch.resize(scratch_floats);
    split.run(u, row, scratch.data(), wide);
  });
  return 0;
}

// How a decode call of these rows on `threads` threads is cut into units (decode_split.h), for
// tests: per unit, its number of rows, KV head, part and shared keys, 4 int64 into `out` (room
// for `max_units`).
// Returns the number of units, -1 when the instruction set is unavailable, -2 for bad arguments.
__attribute__((visibility("default"))) int64_t pds_cpu_decode_units(
    const int64_t* tables, int64_t table_stride, const int64_t* lens, int64_t B, int64_t heads, int64_t kv_heads,
    int64_t head_dim, int64_t block_size, int isa, int threads, int64_t* out, int64_t max_units) {
  const Kernels* k = pick(isa);
  if (k == nullptr) return -1;
  if (B < 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0 || block_size <= 0) return -2;
  const DecodeAttention a{nullptr, 0, nullptr, nullptr, false, tables, table_stride, lens, nullptr,
                          heads, kv_heads, head_dim, block_size, 1.0f};
  DecodeSplit split(a, B, [](int64_t) { return true; }, k == &kAvx512 && decode_avx512_covers(a), threads);
  for (int64_t u = 0; u < std::min(split.units(), max_units); ++u) {
    const DecodeSplit::Unit& w = split.unit(u);
    const int64_t row[4] = {w.count, w.kvh, w.part, w.shared};
    std::copy(row, row + 4, out + 4 * u);
  }
  return split.units();
}

// rows x dim fp32, row-major: x += residual (residual may be null), out = rms_norm(x) * w.
// Returns 0, 1 when AVX2 is unavailable, 2 for bad arguments.
__attribute__((visibility("default"))) int pds_cpu_add_rms_norm(float* x, const float* residual,
                                                                const float* w, float* out, int64_t rows,
                                                                int64_t dim, float eps, int threads) {
  if (pick(ISA_AVX2) == nullptr) return 1;
  if (rows < 0 || dim <= 0) return 2;
  // units of 4 rows: a row is ~1 us, too little to hand to a helper alone
  parallel_for_chunks((rows + 3) / 4, threads, [&](int64_t c) {
    for (int64_t r = c * 4; r < std::min(rows, c * 4 + 4); ++r)
      add_rms_norm_row_avx2(x + r * dim, residual ? residual + r * dim : nullptr, w, out + r * dim, dim, eps);
  });
  return 0;
}

}  // extern "C"
