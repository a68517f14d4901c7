// Quantized matrix x activation products on the CPU: weights in GGUF blocks (Q4_0, Q4_1,
// Q8_0; 32 weights a block, an fp16 scale first), activations quantized to int8 per block of 32
// (scale = amax / 127, rounded to nearest even), products summed in int32 per block and scaled
// in fp32. One translation unit per instruction set (AVX2, AVX-512 VNNI), each compiled with
// its own flags; dispatch.cpp (baseline flags) picks one at run time and owns the threads.
#pragma once
#include <cstdint>

namespace pds_cpu {

constexpr int QK = 32;  // weights (and activations) per block
constexpr int NR = 16;  // weight rows per dequantized panel (the fp32 path)

enum Format : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
enum Isa : int { ISA_AUTO = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
// How activations enter: fp32 (the default: weights dequantized in registers for few rows, in
// panels for many) or quantized to int8 per block of 32 as llama.cpp does (faster integer dot
// products, but the rounding of outlier-heavy activations moves logits; see docs).
enum Path : int { PATH_AUTO = 0, PATH_INT8 = 1, PATH_F32 = 2 };

inline int block_bytes(int fmt) { return fmt == Q4_0 ? 18 : fmt == Q4_1 ? 20 : 34; }

// fp32 value of every fp16 bit pattern (f16_table.cpp, 256 KB, built on first call). The dot
// paths read block scales through it: one scalar load and a broadcast from memory instead of an
// insert, a conversion and a register broadcast, which competed with the weight unpacking for
// the one shuffle port and made those paths shuffle-bound.
const float* f16_table();

// The fp32 scale at `p` (an fp16 in a block), through the table.
inline float table_half(const float* table, const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return table[h];
}

// Activations of M rows quantized per block: q[M][K] int8, d[M][K/32] the block scale,
// s[M][K/32] = d * sum(q) (the term a weight offset multiplies: -8 for Q4_0, m for Q4_1).
struct QuantAct {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K;
};

// One instruction set's kernels.
struct Kernels {
  // Quantize one activation row of K (a multiple of 32) values.
  void (*quantize_row)(const float* x, int64_t K, int8_t* q, float* d, float* s);
  // y[m][n] for m in [m0, m1), n in [n0, n1); w: N rows of K/32 blocks; y row stride ldy.
  void (*gemm)(int fmt, const QuantAct& a, const uint8_t* w, float* y, int64_t ldy,
               int64_t m0, int64_t m1, int64_t n0, int64_t n1);
  // The fp32 path: y[m][n0 + i] for all M rows of x and i < rows (<= 16), through a panel of
  // those weight rows dequantized into `panel` (K x 16 floats, the caller's scratch).
  void (*gemm_f32)(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n0,
                   int rows, float* panel, float* y, int64_t ldy);
  // The fp32 path for few rows: y[m][n] for all M rows, n in [n0, n1), each weight block
  // dequantized in registers and used for every row.
  void (*gemm_dot)(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w, float* y,
                   int64_t ldy, int64_t n0, int64_t n1);
  // Weight rows [n0, n1) dequantized into out (row-major, K floats a row).
  void (*dequantize)(int fmt, const uint8_t* w, int64_t K, int64_t n0, int64_t n1, float* out);
  // The fp32 path uses dequantized panels from this many rows on, gemm_dot below.
  int64_t panel_min_rows;
};

extern const Kernels kAvx2;
extern const Kernels kAvx512;

}  // namespace pds_cpu
