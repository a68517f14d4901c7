// The int16-activation path for decode (few activation rows) on AVX-512: Q4_0/Q4_1 weights
// repacked once at load so one 32-byte load holds two blocks, activations quantized to int16 per
// block of 32, products summed in int32 by vpmaddwd (32 per instruction) and scaled in fp32.
//
// Why: with the GGUF layout every block of 32 weights costs ~15 vector instructions (unpack,
// widen to fp32, dequantize, two FMAs, scalar scale conversions): the fp32 dot path is compute-
// bound at a quarter of memory bandwidth. Here two blocks cost ~12 for one row. int16 (not
// llama.cpp's int8) keeps the activation rounding at amax / 65534 per block: 256x below int8's,
// far below what moved the LM head's logits with int8 (see docs/quantization.md).
//
// Packed layout of one weight row of nb blocks (nbp = nb rounded up to even, padding blocks 0):
//   qs[p * 32 + j] = q(2p, j) | q(2p + 1, j) << 4   for pair p < nbp / 2, j < 32 (q(b, j): the
//                    4-bit value of weight j of block b, natural order)
//   dm[b] = d_b, dm[nbp + b] = m_b (Q4_1: its minimum; Q4_0: -8 d_b)   fp32, so w = d q + m.
#pragma once
#include <cstdint>

namespace pds_cpu {

struct PackedQ4 {
  const uint8_t* qs;  // [N][nbp * 16]
  const float* dm;    // [N][2 * nbp]
  int64_t nbp;        // blocks per row, even
};

// Activation rows prepared for the packed GEMV: a [M][nbp * 32] int16 (a block's values scaled
// by 1 / da, rounded to nearest even), da [M][nbp], xs [M][nbp] = da * (the block's integer sum),
// the sum of the rounded activations, so the GEMV computes dequant(W) . x' for x' the rounded rows.
void packed_prepare_avx512(const float* x, int64_t M, int64_t K, int64_t nbp, int16_t* a, float* da,
                           float* xs);

// The same rounding as fp32 values: out[m][k] = da * round(x[m][k] / da) per block of 32 (da =
// amax / 32767, the quotient taken as x * (1 / da)). Multiplying these by the dequantized weights
// in fp32 is the packed GEMV's product up to summation order: how rows that do not take the
// packed GEMV (more rows, prefill) get the same activations.
void round_int16_avx512(const float* x, int64_t M, int64_t K, float* out);

// y[m][n] for all M rows, n in [n0, n1) (row stride ldy).
void packed_gemv_avx512(const PackedQ4& w, const int16_t* a, const float* da, const float* xs, int64_t M,
                        float* y, int64_t ldy, int64_t n0, int64_t n1);

}  // namespace pds_cpu
