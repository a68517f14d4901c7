// The int16-activation path on AVX-512 VNNI: Q4_0/Q4_1 weights repacked once at load into panels
// of 16 weight rows, activations rounded to int16 per block of 32, products summed in int32 by
// vpdpwssd (32 multiply-adds an instruction, two weights a lane) and scaled in fp32 once a block.
// One kernel for every row count: decode (1 row) to prefill chunks (hundreds).
//
// Why: in the GGUF layout every block of 32 weights costs ~15 vector instructions for one row on
// fp32 activations (unpack, widen, convert, dequantize, two FMAs, scalar scales), and a dequantized
// fp32 panel feeds one FMA per 16 multiply-adds: both compute-bound well below memory bandwidth.
// Here a block of 16 rows costs 8 widenings, 16 masks/shifts, then per activation row 16 vpdpwssd
// with broadcast activation pairs and 4 scaling instructions (the scales are vectors over the 16
// rows). int16 (not llama.cpp's int8) keeps the activation rounding at amax / 65534 per block:
// 256x below int8's, far below what moved the LM head's logits with int8 (docs/quantization.md).
//
// Packed layout of N weight rows of nb blocks, in P = ceil(N / 16) panels (rows past N zero):
//   qs[((p * nb + b) * 8 + c) * 32 + j], chunk c < 8 of block b, byte j < 32, for row 16p + j/2:
//       low nibble  = q(b, 4c + j % 2),  high nibble = q(b, 4c + 2 + j % 2)
//     (q(b, i): the 4-bit value of weight i of block b), so one widened 32-byte chunk masked
//     (shifted) holds, per int32 lane, the pair of weights 4c, 4c+1 (4c+2, 4c+3) of one row.
//   dm[(p * nb + b) * 32 + i] = d of row 16p + i in block b, dm[... + 16 + i] = its m (Q4_1: the
//     minimum; Q4_0: -8 d), fp32, so w = d q + m.
//
// Q8_0 (the LM head: its 8-bit weights, one scale a block) packs the same way with whole bytes:
//   qs[((p * nb + b) * 16 + c) * 32 + j], chunk c < 16, byte j: weight 2c + j % 2 of row 16p + j/2
//     (int8), so one sign-extended chunk holds per int32 lane the pair 2c, 2c+1 of one row;
//   dm[(p * nb + b) * 16 + i] = d of row 16p + i in block b (no offsets).
//
// Every output is sum_b (d_b da_b) * S_b + m_b xs_b in block order, S_b the block's exact integer
// sum (Q4: |S_b| <= 32 * 15 * 32767 < 2^24, so its fp32 conversion is exact too; Q8_0's converts
// with fp32 rounding): the arithmetic of an output does not depend on how many rows share the
// call or how threads split it.
#pragma once
#include <cstdint>

namespace pds_cpu {

constexpr int kPanelRows = 16;  // weight rows per packed panel

struct Packed {
  const uint8_t* qs;  // [P][nb][256] (Q4), [P][nb][512] (Q8_0)
  const float* dm;    // [P][nb][32] (Q4), [P][nb][16] (Q8_0)
  int64_t nb;         // blocks per row
  bool q8;            // Q8_0 (else Q4_0 / Q4_1)
};

// Activation rows prepared for the packed product: a [M][K] int16 (a block's values scaled by
// 1 / da, rounded to nearest even), da [M][K/32], xs [M][K/32] = da * (the block's integer sum),
// the sum of the rounded activations, so the product is dequant(W) . x' for x' the rounded rows.
void packed_prepare_avx512(const float* x, int64_t M, int64_t K, int16_t* a, float* da, float* xs);

// y[m][n] for rows m in [m0, m1), n in the panels [p0, p1) (n < N), row stride ldy; a, da, xs as
// prepared above.
void packed_gemm_avx512(const Packed& w, const int16_t* a, const float* da, const float* xs, int64_t m0,
                        int64_t m1, int64_t N, float* y, int64_t ldy, int64_t p0, int64_t p1);

}  // namespace pds_cpu
